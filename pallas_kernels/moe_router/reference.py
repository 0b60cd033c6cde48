"""The noaux_tc expert selection (DeepSeek-V3's router after its logits) written with jax.lax.top_k: the reference
the Pallas Triton kernel (triton.py) is compared with, and what runs where the kernel does not."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def select_noaux_tc(scores: jax.Array, bias: jax.Array, *, k: int, n_group: int, topk_group: int
                    ) -> tuple[jax.Array, jax.Array]:
  """scores f32 [T, E] (sigmoid of the logits), bias f32 [E] -> (ids int32 [T, k], weights f32 [T, k]).

  Selection on the bias-corrected scores: groups (E / n_group experts each) ranked by the sum of their two best
  corrected scores, the topk_group best groups kept, the k best kept experts chosen; weights are the uncorrected
  scores of the chosen experts (not normalised). Ties go to the lower index (jax.lax.top_k's order)."""
  t, e = scores.shape
  choice = scores + bias                                                             # [T, E]
  group_score = jax.lax.top_k(choice.reshape(t, n_group, e // n_group), 2)[0].sum(-1)    # [T, G]
  _, gidx = jax.lax.top_k(group_score, topk_group)                                   # [T, topk_group]
  keep = jnp.any(jax.nn.one_hot(gidx, n_group, dtype=jnp.bool_), axis=1)            # [T, G]
  choice = jnp.where(jnp.repeat(keep, e // n_group, axis=-1), choice, -jnp.inf)
  _, ids = jax.lax.top_k(choice, k)                                                  # [T, k]
  return ids.astype(jnp.int32), jnp.take_along_axis(scores, ids, axis=-1)
