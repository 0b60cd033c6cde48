"""group_topk as one Pallas Triton kernel (sm80+, or interpret mode): the selection in one launch.

The XLA form (reference.py) is ~8 kernels at DeepSeek-V3's router (E = 256, 8 groups, top-4 groups, top-8): three
sorts for the three lax.top_k, then the gathers (H200, T = 64: 13.9 µs of kernels plus a launch gap after each,
w4a16 NOTES "router"). A program here holds a [16, E_pad] tile of tokens and works in registers:

  choice = s + bias;  per group g: m1 = its max, m2 = its max with m1's first position removed, score_g = m1 + m2
  rank of each group among the groups (greater score, or equal score and lower index, ranks before): kept if
  rank < topk_group;  then top_k rounds of (max, its lowest position among the still available, taken).

The chosen ids are lax.top_k's (ties to the lower index in both top-ks; the group sums are the same two f32 added
in the same order); the weights are the same scores, but their normalising sum is added in k order, which may
round differently from XLA's reduction by an ulp.
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

TOKENS = 16            # tokens per program
MAX_EXPERTS = 1024


def _pow2(n: int) -> int:
  return 1 << max(0, int(n) - 1).bit_length()


def supported(num_experts: int, num_groups: int, top_k: int, topk_group: int) -> bool:
  """Sizes the kernel takes (else use reference.group_topk)."""
  return (2 <= num_experts <= MAX_EXPERTS and num_groups >= 1 and num_experts % num_groups == 0
          and num_experts // num_groups >= 2 and 1 <= topk_group <= num_groups
          and 1 <= top_k <= topk_group * (num_experts // num_groups))


def _kernel(s_ref, b_ref, ids_ref, w_ref, *, t_total: int, e: int, e_pad: int, groups: int, topk_group: int,
            top_k: int, norm: bool, scale: float):
  t0 = pl.program_id(0) * TOKENS
  rows = t0 + lax.broadcasted_iota(jnp.int32, (TOKENS,), 0)
  row_ok = rows < t_total
  col = lax.broadcasted_iota(jnp.int32, (1, e_pad), 1)
  col_ok = col < e
  scores = s_ref[pl.ds(t0, TOKENS), :]                       # [TB, E_pad] (the wrapper pads rows and columns)
  choice = scores + b_ref[...][None, :]
  neg = jnp.float32(-jnp.inf)
  size = e // groups
  group_of = jnp.where(col_ok, col // size, groups)                                   # padding: no group

  group_scores = []
  for g in range(groups):
    in_g = group_of == g
    m1 = jnp.max(jnp.where(in_g, choice, neg), axis=1, keepdims=True)                 # [TB, 1]
    first = jnp.min(jnp.where(in_g & (choice == m1), col, e_pad), axis=1, keepdims=True)
    m2 = jnp.max(jnp.where(in_g & (col != first), choice, neg), axis=1, keepdims=True)
    group_scores.append(m1 + m2)
  mine = jnp.full((TOKENS, e_pad), neg)                                              # each column's group score
  for g in range(groups):
    mine = jnp.where(group_of == g, group_scores[g], mine)
  ahead = jnp.zeros((TOKENS, e_pad), jnp.int32)                                      # groups ranked before it
  for g in range(groups):
    before = (group_scores[g] > mine) | ((group_scores[g] == mine) & (g < group_of))
    ahead = ahead + before.astype(jnp.int32)
  avail = col_ok & (ahead < topk_group)
  masked = jnp.where(avail, choice, neg)
  avail = col_ok & jnp.ones((TOKENS, 1), jnp.bool_)       # lax.top_k may pick -inf entries too, lowest index first

  ids, ws = [], []
  for _ in range(top_k):
    m = jnp.max(jnp.where(avail, masked, neg), axis=1, keepdims=True)
    pick = jnp.min(jnp.where(avail & (masked == m), col, e_pad), axis=1, keepdims=True)   # [TB, 1]
    hit = col == pick
    ids.append(pick)
    ws.append(jnp.sum(jnp.where(hit, scores, 0.0), axis=1, keepdims=True))
    avail = avail & ~hit
  total = ws[0]
  for w in ws[1:]:
    total = total + w
  for i in range(top_k):
    w = ws[i] / (total + 1e-20) if norm else ws[i]
    pltriton.store(ids_ref.at[pl.ds(t0, TOKENS), pl.ds(i, 1)], ids[i], mask=row_ok[:, None])
    pltriton.store(w_ref.at[pl.ds(t0, TOKENS), pl.ds(i, 1)], w * scale, mask=row_ok[:, None])


@functools.lru_cache(maxsize=None)
def _call(*, t: int, e: int, groups: int, topk_group: int, top_k: int, norm: bool, scale: float, interpret: bool):
  e_pad = _pow2(e)
  kernel = functools.partial(_kernel, t_total=t, e=e, e_pad=e_pad, groups=groups, topk_group=topk_group,
                             top_k=top_k, norm=norm, scale=scale)
  grid = (-(-t // TOKENS),)
  rows = grid[0] * TOKENS
  out_shape = (jax.ShapeDtypeStruct((rows, top_k), jnp.int32), jax.ShapeDtypeStruct((rows, top_k), jnp.float32))

  def call(scores, bias):
    scores = jnp.pad(scores, ((0, rows - t), (0, e_pad - e)))
    bias = jnp.pad(bias, (0, e_pad - e))
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", DeprecationWarning)
      ids, w = pl.pallas_call(kernel, out_shape=out_shape, grid=grid, interpret=interpret, name="moe_group_topk",
                              compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1))(scores, bias)
    return ids[:t], w[:t]

  return jax.jit(call)


def group_topk(scores, bias, *, top_k: int, num_groups: int, topk_group: int, norm_topk_prob: bool, scale: float,
               interpret: bool = False):
  """reference.group_topk's contract in one kernel."""
  t, e = scores.shape
  if not supported(e, num_groups, top_k, topk_group):
    raise ValueError(f"moe_router triton: E={e}, {num_groups} groups, top-{topk_group} groups, top-{top_k} is "
                     f"outside the kernel's sizes (E <= {MAX_EXPERTS}, >= 2 experts a group, top_k <= the kept "
                     "groups' experts); use backend='xla'.")
  return _call(t=t, e=e, groups=num_groups, topk_group=topk_group, top_k=top_k, norm=bool(norm_topk_prob),
               scale=float(scale), interpret=bool(interpret))(scores.astype(jnp.float32), bias.astype(jnp.float32))
