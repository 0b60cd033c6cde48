"""XLA reference for the w4a16 ops: dequantize the int4 weights, then an ordinary dot (any device).

This is the `xla` backend and the baseline the kernels are tested and timed against. It materialises the
dequantized weights (per expert block for the MoE), which is exactly the cost the kernels exist to avoid.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.w4a16 import layout, routing


def _precision(dtype):
  # float32 activations get true float32 products (no TF32), so float32 models match float32 references.
  return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


def matmul(x: jax.Array, w: layout.W4A16Weight, out_dtype=None) -> jax.Array:
  """x [M, K] @ W [K, N] -> [M, N] in out_dtype (default x.dtype); W dequantized in float32 and rounded once to
  x.dtype."""
  wd = layout.dequantize(w, x.dtype)
  y = jnp.dot(x, wd, preferred_element_type=jnp.float32, precision=_precision(x.dtype))
  return y.astype(out_dtype or x.dtype)


def _take_expert(w: layout.W4A16Weight, e) -> layout.W4A16Weight:
  return layout.W4A16Weight(packed=w.packed[e], scales=w.scales[e], zeros=w.zeros[e], k=w.k, n=w.n,
                            group_size=w.group_size)


def moe(x: jax.Array, topk_ids: jax.Array, topk_weights: jax.Array, w13: layout.W4A16Weight,
        w2: layout.W4A16Weight, *, block_m: int = 16) -> jax.Array:
  """Σ_k w[t,k] · down_e(silu(gate_e x_t) · up_e x_t), e = topk_ids[t,k]; x [T, D] -> [T, D] in x.dtype.

  w13 [E] stacks gate (columns [0, I)) and up (columns [I, 2I)); w2 [E] is down [I, D]. A loop over the
  expert blocks in use dequantizes one expert per block (never all E at once)."""
  t, d = x.shape
  n_inter = w13.n // 2
  rt = routing.align(topk_ids, topk_weights, w13.lead_shape[0], block_m)
  n_used = jnp.sum(rt.block_expert >= 0)
  prec = _precision(x.dtype)

  def block(i, rows_out):
    e = jnp.maximum(rt.block_expert[i], 0)
    tok = jax.lax.dynamic_slice_in_dim(rt.row_token, i * block_m, block_m)
    wgt = jax.lax.dynamic_slice_in_dim(rt.row_weight, i * block_m, block_m)
    xb = jnp.where((tok >= 0)[:, None], x[jnp.maximum(tok, 0)], 0).astype(x.dtype)      # [bm, D]
    gu = jnp.dot(xb, layout.dequantize(_take_expert(w13, e), x.dtype), preferred_element_type=jnp.float32,
                 precision=prec).astype(x.dtype)
    h = (jax.nn.silu(gu[:, :n_inter]) * gu[:, n_inter:])[:, :w2.k].astype(x.dtype)   # drop tile padding
    y = jnp.dot(h, layout.dequantize(_take_expert(w2, e), x.dtype), preferred_element_type=jnp.float32,
                precision=prec).astype(x.dtype)
    y = y.astype(jnp.float32) * wgt[:, None]
    return jax.lax.dynamic_update_slice_in_dim(rows_out, y, i * block_m, axis=0)

  rows = jnp.zeros((rt.num_blocks * block_m, d), jnp.float32)
  rows = jax.lax.fori_loop(0, n_used, block, rows)
  return routing.combine(rows, rt).astype(x.dtype)
