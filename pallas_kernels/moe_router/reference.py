"""group_topk in XLA with jax.lax.top_k: the reference, and what runs off CUDA GPUs."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def group_topk(scores: jax.Array, bias: jax.Array, *, top_k: int, num_groups: int, topk_group: int,
               norm_topk_prob: bool, scale: float) -> tuple[jax.Array, jax.Array]:
  """scores f32 [T, E] (sigmoid of the logits), bias f32 [E] -> (ids int32 [T, K], weights f32 [T, K]).

  Selection uses the biased scores s + bias; a group's score is the sum of its two best; the topk_group best
  groups are kept (others -inf); the top_k of what is left are chosen (ties: the lower index, as lax.top_k);
  weights are the unbiased scores of the chosen, divided by their sum (+1e-20) if norm_topk_prob, times scale."""
  t, e = scores.shape
  choice = scores + bias
  group_score = jax.lax.top_k(choice.reshape(t, num_groups, e // num_groups), 2)[0].sum(-1)     # [T, G]
  _, gidx = jax.lax.top_k(group_score, topk_group)                                              # [T, topk_group]
  keep = jnp.repeat(jnp.any(jax.nn.one_hot(gidx, num_groups, dtype=jnp.bool_), axis=1), e // num_groups, axis=-1)
  _, ids = jax.lax.top_k(jnp.where(keep, choice, -jnp.inf), top_k)
  w = jnp.take_along_axis(scores, ids, axis=-1)
  if norm_topk_prob:
    w = w / (w.sum(-1, keepdims=True) + 1e-20)
  return ids.astype(jnp.int32), (w * scale).astype(jnp.float32)
