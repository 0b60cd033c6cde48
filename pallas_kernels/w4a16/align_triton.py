"""routing.align as one Pallas Triton kernel: the MoE's grouping of (token, expert) pairs in a single launch.

routing.align (the XLA reference, same outputs bit for bit) is about 11 small XLA kernels at decode sizes (T = 64,
top-8 of 256 experts on an H200: 12.9 µs of kernels plus a launch gap after each; w4a16 NOTES, "router"). Here one
program of 8 warps does it all with the same arithmetic (pair ranks by compare-and-count, experts' block ends by
a running prefix sum), in chunks so that no register tile exceeds [P_pad, 32]:

  pass 1, over chunks of 32 earlier pairs (reloaded from GMEM):   rank[p] = #{p' < p : id[p'] = id[p]}
  pass 2, over chunks of 32 experts e, carrying the blocks before the chunk:
          count[e] = #{p : id[p] = e};  end[e] = prefix + cumsum(ceil(count / block_m))
          expert[b] += #{e in chunk : end[e] <= b};  start[p] += end[e_p] - blocks[e_p] if e_p in the chunk
  then    pair_row[p] = start[p] block_m + rank[p] (kept pairs), block_expert[b] (-1 past the blocks in use),
          row_token / row_weight: every row set to (-1, 0), a CTA barrier, then each kept pair's row written
          (dropped pairs write a slot of their own past the rows).

Shapes are static as in routing.align (NB = routing.max_blocks); only sizes up to MAX_PAIRS pairs and
MAX_EXPERTS experts take this path (routing.align's pairwise rank has the same kind of bound); api.py picks it on
CUDA GPUs (and in interpret mode when asked) and keeps routing.align elsewhere and for one token.
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

from pallas_kernels.w4a16 import routing

CHUNK = 32            # pairs or experts per step of the two passes
ROW_CHUNK = 512       # rows per store of the row_token / row_weight initialisation
MAX_PAIRS = 2048      # T * K up to this: a [P_pad, 32] tile of int32 is 8 registers a thread at 2048 / 256 threads
MAX_EXPERTS = 1024


def _pow2(n: int) -> int:
  return 1 << max(0, int(n) - 1).bit_length()


def supported(num_pairs: int, num_experts: int) -> bool:
  """Whether align() takes these sizes (else use routing.align)."""
  return 1 <= num_pairs <= MAX_PAIRS and 1 <= num_experts <= MAX_EXPERTS


def _kernel(ids_ref, w_ref, block_expert_ref, row_token_ref, row_weight_ref, pair_row_ref, *, k: int,
            num_experts: int, block_m: int, num_blocks: int, p_pad: int, nb_pad: int, rows_pad: int, on_gpu: bool):
  rows_total = num_blocks * block_m
  ids = ids_ref[...]                                                     # [P_pad] (padding pairs: -1)
  kept = (ids >= 0) & (ids < num_experts)
  ids = jnp.where(kept, ids, -1)                                         # dropped ids never match an expert
  pidx = lax.broadcasted_iota(jnp.int32, (p_pad,), 0)

  def rank_step(c, rank):                                                # pass 1
    ch = ids_ref[pl.ds(c * CHUNK, CHUNK)]                                # [C] earlier candidates
    ch = jnp.where((ch >= 0) & (ch < num_experts), ch, -2)               # never equal to a kept id, nor to -1
    cidx = c * CHUNK + lax.broadcasted_iota(jnp.int32, (1, CHUNK), 1)
    same = (ch[None, :] == ids[:, None]) & (cidx < pidx[:, None])        # [P_pad, C]
    return rank + jnp.sum(same.astype(jnp.int32), axis=1)

  rank = lax.fori_loop(0, p_pad // CHUNK, rank_step, jnp.zeros((p_pad,), jnp.int32))

  bidx = lax.broadcasted_iota(jnp.int32, (nb_pad,), 0)

  def expert_step(c, carry):                                             # pass 2
    prefix, expert, start = carry
    e = c * CHUNK + lax.broadcasted_iota(jnp.int32, (CHUNK,), 0)          # [C] experts of this chunk
    hit = ids[:, None] == e[None, :]                                     # [P_pad, C]
    count = jnp.sum(hit.astype(jnp.int32), axis=0)                       # [C] (0 past num_experts)
    blocks = (count + (block_m - 1)) // block_m
    end = prefix + jnp.cumsum(blocks)                                    # exclusive block end of each expert
    expert = expert + jnp.sum((end[None, :] <= bidx[:, None]).astype(jnp.int32), axis=1)
    start = start + jnp.sum(jnp.where(hit, (end - blocks)[None, :], 0), axis=1)
    return prefix + jnp.sum(blocks), expert, start

  n_used, expert, start = lax.fori_loop(
      0, -(-num_experts // CHUNK), expert_step,
      (jnp.int32(0), jnp.zeros((nb_pad,), jnp.int32), jnp.zeros((p_pad,), jnp.int32)))

  row = start * block_m + rank
  pair_row_ref[...] = jnp.where(kept, row, -1)
  block_expert = jnp.where(bidx < n_used, jnp.minimum(expert, num_experts - 1), -1)
  pltriton.store(block_expert_ref.at[pl.ds(0, nb_pad)], block_expert, mask=bidx < num_blocks)

  for r0 in range(0, rows_total, ROW_CHUNK):                             # every row padding first ...
    r = r0 + lax.broadcasted_iota(jnp.int32, (ROW_CHUNK,), 0)
    pltriton.store(row_token_ref.at[pl.ds(r0, ROW_CHUNK)], jnp.full((ROW_CHUNK,), -1, jnp.int32),
                   mask=r < rows_total)
    pltriton.store(row_weight_ref.at[pl.ds(r0, ROW_CHUNK)], jnp.zeros((ROW_CHUNK,), jnp.float32),
                   mask=r < rows_total)
  if on_gpu:      # interpret mode runs the program's stores in order and has no barrier
    pltriton.debug_barrier()                                             # ... visible before the pairs' rows
  # dropped and padding pairs write their own slot past the rows (sliced off): an unmasked scatter with no two
  # lanes on one address, so no write order between lanes matters (and interpret mode's masked scatter, which
  # writes the old value back at masked lanes, is never relied on)
  target = jnp.where(kept, row, rows_pad + pidx)
  pltriton.store(row_token_ref.at[target], pidx // k)
  pltriton.store(row_weight_ref.at[target], w_ref[...])


@functools.lru_cache(maxsize=None)
def _call(*, p: int, k: int, num_experts: int, block_m: int, interpret: bool):
  num_blocks = max(1, routing.max_blocks(p, num_experts, block_m))
  p_pad, nb_pad = max(CHUNK, _pow2(p)), _pow2(num_blocks)
  rows_pad = -(-num_blocks * block_m // ROW_CHUNK) * ROW_CHUNK
  kernel = functools.partial(_kernel, k=k, num_experts=num_experts, block_m=block_m, num_blocks=num_blocks,
                             p_pad=p_pad, nb_pad=nb_pad, rows_pad=rows_pad, on_gpu=not interpret)
  out_shape = (jax.ShapeDtypeStruct((nb_pad,), jnp.int32), jax.ShapeDtypeStruct((rows_pad + p_pad,), jnp.int32),
               jax.ShapeDtypeStruct((rows_pad + p_pad,), jnp.float32), jax.ShapeDtypeStruct((p_pad,), jnp.int32))

  def call(ids, weights):
    ids = jnp.pad(ids, (0, p_pad - p), constant_values=-1)
    weights = jnp.pad(weights, (0, p_pad - p))
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", DeprecationWarning)
      block_expert, row_token, row_weight, pair_row = pl.pallas_call(
          kernel, out_shape=out_shape, grid=(1,), interpret=interpret, name="w4a16_align",
          compiler_params=pltriton.CompilerParams(num_warps=8, num_stages=1))(ids, weights)
    rows = num_blocks * block_m
    return block_expert[:num_blocks], row_token[:rows], row_weight[:rows], pair_row[:p]

  return jax.jit(call)


def align(topk_ids: jax.Array, topk_weights: jax.Array, num_experts: int, block_m: int, *,
          interpret: bool = False) -> routing.Routing:
  """routing.align (same outputs) in one kernel; sizes where supported(T * K, num_experts)."""
  t, k = topk_ids.shape
  if not supported(t * k, num_experts):
    raise ValueError(f"align_triton: {t * k} pairs over {num_experts} experts is outside the kernel's sizes "
                     f"(pairs <= {MAX_PAIRS}, experts <= {MAX_EXPERTS}); use routing.align.")
  block_expert, row_token, row_weight, pair_row = _call(p=t * k, k=k, num_experts=int(num_experts),
                                                         block_m=int(block_m), interpret=bool(interpret))(
      topk_ids.reshape(-1).astype(jnp.int32), topk_weights.reshape(-1).astype(jnp.float32))
  return routing.Routing(block_expert=block_expert, row_token=row_token, row_weight=row_weight,
                         pair_row=pair_row.reshape(t, k), block_m=int(block_m))
