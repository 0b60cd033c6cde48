"""The `xla` backend: MLA decode in plain JAX, any device. Also the reference the kernels are tested against.

Gathers each sequence's pages through its block table, dequantizes (fp8) and computes exact-f32 attention:
q.k products are bf16 x bf16 (or f32 x f32 for a float32 cache) accumulated in f32, P.V runs in f32 at HIGHEST
precision. Keys past a sequence's length (and, with causal, past each query's position) are masked by select,
values by select too (0 * NaN would be NaN), so NaN-filled unused pages never reach a sum.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.mla_decode.cache import LATENT_DIM, MLAKVCache


def mla_decode(q: jax.Array, cache: MLAKVCache, block_table: jax.Array, seq_lens: jax.Array, *,
               softmax_scale: float, causal: bool, interpret: bool = False) -> tuple[jax.Array, jax.Array]:
  """q [B, Sq, H, 576] -> out [B, Sq, H, 512] (q.dtype), lse f32 [B, H, Sq]. Inputs already validated."""
  del interpret  # plain XLA: nothing to interpret
  b, sq, h, _ = q.shape
  ps = cache.page_size
  max_pages = block_table.shape[1]
  n = max_pages * ps
  # Entries past a sequence's pages may hold anything: clip so the gather stays in bounds, mask below.
  pages = jnp.clip(block_table, 0, cache.num_pages - 1)
  compute_dt = jnp.float32 if cache.dtype == "float32" or q.dtype == jnp.float32 else jnp.bfloat16
  # fp8 values times a power-of-two scale are exact in bf16, so this cast loses nothing.
  latent, rope = cache.gather(pages, compute_dt)                    # [B, N, 512], [B, N, 64]
  kv = jnp.concatenate([latent, rope], axis=-1)                     # [B, N, 576]

  pos = jnp.arange(n, dtype=jnp.int32)
  lens = seq_lens.astype(jnp.int32)
  in_seq = pos[None, :] < lens[:, None]                                   # [B, N]
  kv = jnp.where(in_seq[..., None], kv, jnp.zeros((), compute_dt))        # NaN pages -> 0 before any product
  if causal and sq > 1:
    # bottom-right aligned: query i sees keys [0, L - Sq + i]
    last = lens[:, None] - sq + jnp.arange(sq, dtype=jnp.int32)[None, :]  # [B, Sq]
    visible = pos[None, None, :] <= last[..., None]                        # [B, Sq, N]
    visible = visible & in_seq[:, None, :]
  else:
    visible = jnp.broadcast_to(in_seq[:, None, :], (b, sq, n))

  scores = jnp.einsum("bshc,bnc->bhsn", q.astype(compute_dt), kv, preferred_element_type=jnp.float32,
                      precision=jax.lax.Precision.HIGHEST) * jnp.float32(softmax_scale)
  scores = jnp.where(visible[:, None], scores, -jnp.inf)                    # [B, H, Sq, N]
  m = jnp.max(scores, axis=-1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.exp(scores - m)
  denom = jnp.sum(p, axis=-1, keepdims=True)
  o = jnp.einsum("bhsn,bnc->bshc", p, kv[..., :LATENT_DIM].astype(jnp.float32),
                 precision=jax.lax.Precision.HIGHEST)                       # [B, Sq, H, 512]
  denom_bsh = jnp.transpose(denom[..., 0], (0, 2, 1))[..., None]            # [B, Sq, H, 1]
  empty = denom_bsh == 0
  out = jnp.where(empty, 0.0, o / jnp.where(empty, 1.0, denom_bsh))
  lse = jnp.where(denom[..., 0] > 0, m[..., 0] + jnp.log(denom[..., 0]), jnp.inf)   # [B, H, Sq]
  return out.astype(q.dtype), lse


def mla_decode_numpy(q, latent, rope, block_table, seq_lens, *, softmax_scale, causal, page_size,
                     return_abs=False):
  """float64 NumPy reference on a dequantized cache (latent [P, ps, 512], rope [P, ps, 64] as float arrays).

  Independent of JAX: loops over sequences and reads only the pages a sequence owns. Returns
  (out f64 [B, Sq, H, 512], lse f64 [B, H, Sq]) with out 0 / lse +inf where a query sees no key; with
  return_abs also sum_i p_i |v_i| / sum_i p_i per output element (the scale of rounding errors in P . V).
  """
  import numpy as np
  q = np.asarray(q, np.float64)
  latent, rope = np.asarray(latent, np.float64), np.asarray(rope, np.float64)
  block_table, seq_lens = np.asarray(block_table), np.asarray(seq_lens)
  b, sq, h, _ = q.shape
  out = np.zeros((b, sq, h, latent.shape[-1]))
  out_abs = np.zeros_like(out)
  lse = np.full((b, h, sq), np.inf)
  for i in range(b):
    length = int(seq_lens[i])
    npages = -(-length // page_size)
    pages = block_table[i, :npages]
    k_lat = latent[pages].reshape(-1, latent.shape[-1])[:length]
    k_rope = rope[pages].reshape(-1, rope.shape[-1])[:length]
    k = np.concatenate([k_lat, k_rope], axis=-1)                     # [L, 576]
    for s in range(sq):
      visible = length - sq + s + 1 if (causal and sq > 1) else length
      if visible <= 0:
        continue
      scores = q[i, s] @ k[:visible].T * softmax_scale               # [H, visible]
      m = scores.max(axis=-1, keepdims=True)
      p = np.exp(scores - m)
      denom = p.sum(axis=-1, keepdims=True)
      out[i, s] = (p / denom) @ k_lat[:visible]
      out_abs[i, s] = (p / denom) @ np.abs(k_lat[:visible])
      lse[i, :, s] = (m + np.log(denom))[:, 0]
  return (out, lse, out_abs) if return_abs else (out, lse)
