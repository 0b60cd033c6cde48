"""The noaux_tc expert selection as one Pallas Triton kernel (sm80+; CPU with interpret=True): a program per
token, its E scores as [G, E / G] in one warp. XLA runs the selection as ~10 small kernels (three sorts for the
three top-ks; ~14 µs at T = 64 on an H200, NOTES.md); here it is one launch. Same ids and weights, to the bit, as
reference.select_noaux_tc (tests compare them).

Each top-k is a loop of picks: the largest value left, the lowest index holding it (jax.lax.top_k's tie order),
then that index taken out. The group score is the sum of a group's two best corrected scores (the best taken out
once, so a repeated best counts twice, as top_k's two values do). Powers of two throughout (Pallas Triton): E / G
and G as they come (DeepSeek-V3: 8 x 32), k padded to a power of two in the stores' lanes. A NaN score matches no
pick: its token's ids there come out as E, out of range, which the grouped MoE drops (the token's hidden state is
NaN already).
"""
from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

with warnings.catch_warnings():
  warnings.simplefilter("ignore", DeprecationWarning)
  from jax.experimental.pallas import triton as pltriton

NUM_WARPS = 1        # a token's 256 scores are 8 a lane: every reduction stays within the warp


def _pow2(n: int) -> bool:
  return n >= 1 and n & (n - 1) == 0


def supports(num_experts: int, n_group: int, k: int) -> bool:
  """Whether the kernel takes this shape (powers of two for the groups and their sizes, at least two experts a
  group as the group score needs)."""
  return (n_group >= 1 and num_experts % n_group == 0 and _pow2(n_group) and _pow2(num_experts // n_group)
          and num_experts // n_group >= 2 and 1 <= k <= num_experts)


def _select_kernel(scores_ref, bias_ref, ids_ref, w_ref, *, k: int, topk_group: int):
  g, per = scores_ref.shape                                                   # [G, E / G] of this token
  scores = scores_ref[...]
  choice = scores + bias_ref[...]
  col = lax.broadcasted_iota(jnp.int32, (g, per), 1)
  flat = lax.broadcasted_iota(jnp.int32, (g, per), 0) * per + col             # expert index
  neg = jnp.float32(-jnp.inf)
  # group score: the two best of each group
  best = jnp.max(choice, axis=1)                                              # [G]
  first = jnp.min(jnp.where(choice == best[:, None], col, per), axis=1)
  second = jnp.max(jnp.where(col == first[:, None], neg, choice), axis=1)
  group_score = best + second
  # the topk_group best groups
  g_iota = lax.broadcasted_iota(jnp.int32, (g,), 0)
  taken = jnp.zeros((g,), jnp.bool_)
  for _ in range(topk_group):
    m = jnp.max(jnp.where(taken, neg, group_score))
    i = jnp.min(jnp.where(~taken & (group_score == m), g_iota, g))
    taken = taken | (g_iota == i)
  # the k best experts of the kept groups
  left = taken[:, None] & (col >= 0)                                          # [G, E / G] still choosable
  kp = 1 << (k - 1).bit_length()
  k_iota = lax.broadcasted_iota(jnp.int32, (kp,), 0)
  ids = jnp.zeros((kp,), jnp.int32)
  weights = jnp.zeros((kp,), jnp.float32)
  for j in range(k):
    m = jnp.max(jnp.where(left, choice, neg))
    i = jnp.min(jnp.where(left & (choice == m), flat, g * per))
    pick = flat == i
    ids = jnp.where(k_iota == j, i, ids)
    weights = jnp.where(k_iota == j, jnp.sum(jnp.where(pick, scores, 0.0)), weights)   # one nonzero term: exact
    left = left & ~pick
  lanes = jnp.where(k_iota < k, k_iota, kp + k)                               # lanes past k: out of range, masked
  pltriton.store(ids_ref.at[lanes], ids, mask=k_iota < k)
  pltriton.store(w_ref.at[lanes], weights, mask=k_iota < k)


def select_noaux_tc(scores: jax.Array, bias: jax.Array, *, k: int, n_group: int, topk_group: int,
                    interpret: bool = False) -> tuple[jax.Array, jax.Array]:
  """As reference.select_noaux_tc: scores f32 [T, E], bias f32 [E] -> (ids int32 [T, k], weights f32 [T, k])."""
  t, e = scores.shape
  if not supports(e, n_group, k) or not 1 <= topk_group <= n_group:
    raise ValueError(f"moe_router triton: takes E / n_group and n_group powers of two, 1 <= k <= E and 1 <= "
                     f"topk_group <= n_group; got E={e}, n_group={n_group}, k={k}, topk_group={topk_group}. Use "
                     "backend='xla'.")
  per = e // n_group
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    return pl.pallas_call(
        functools.partial(_select_kernel, k=k, topk_group=topk_group),
        grid=(t,),
        in_specs=[pl.BlockSpec((None, n_group, per), lambda i: (i, 0, 0)),
                  pl.BlockSpec((n_group, per), lambda i: (0, 0))],
        out_specs=[pl.BlockSpec((None, k), lambda i: (i, 0)), pl.BlockSpec((None, k), lambda i: (i, 0))],
        out_shape=[jax.ShapeDtypeStruct((t, k), jnp.int32), jax.ShapeDtypeStruct((t, k), jnp.float32)],
        interpret=bool(interpret),
        compiler_params=pltriton.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
        name="moe_router_select",
    )(scores.astype(jnp.float32).reshape(t, n_group, per), bias.astype(jnp.float32).reshape(n_group, per))
