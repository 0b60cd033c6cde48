"""routing.align as one Pallas Triton launch (sm80+; CPU with interpret=True): the grouping of a decode batch's
(token, expert) pairs by expert in a single launch instead of XLA's ~10 small kernels (~13 µs at T = 64 on an
H200, NOTES.md). Same Routing, to the bit, as routing.align (the reference the tests compare it with).

Program c takes pair chunk c (PAIR_CHUNK pairs) and block chunk c (BLOCK_CHUNK blocks); every array a power of
two, as Pallas Triton needs:
1. the one-hots [C, E'] of the pair chunks' experts (E' = E padded to a power of two; dropped ids match nothing),
   summed, give the per-expert counts of all pairs and of the chunks before c (every program walks all chunks:
   P <= MAX_PAIRS keeps that a few thousand cycles, and the programs run side by side). All loads come first: the
   kernel is latency-bound, and a reduction's barrier between loads would serialise their round trips;
2. blocks per expert = ceil(count / block_m); their cumsum is each expert's first block;
3. a pair's rank in its expert's run = that expert's count before chunk c + a [C, C] compare within the chunk;
   row = first block of its expert x block_m + rank -> pair_row, and row_token / row_weight scattered to that row
   (a kept pair's row is unique; dropped pairs store nothing);
4. a block's expert = experts whose blocks end at or before it (-1 past the blocks in use), and its padding rows
   (past its expert's count) get token -1 / weight 0 by a masked store.
Steps 3 and 4 write disjoint elements, so no ordering between threads is needed.
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

from pallas_kernels.w4a16.routing import Routing, max_blocks

PAIR_CHUNK = 32      # pairs a program and a one-hot chunk ([32, E']); 32 at 8 warps measured fastest (NOTES v30)
BLOCK_CHUNK = 32     # blocks a chunk ([32, E'] compares)
MAX_PAIRS = 1024     # every program walks all pairs' chunks (T = 128 at top-8); larger batches take routing.align
NUM_WARPS = 8        # 4 warps at 64 pairs a chunk ran 10x slower (two [64, E'] accumulators, 256 int32 a thread)


def _pow2(n: int) -> int:
  return 1 << max(0, n - 1).bit_length()


def _align_kernel(ids_ref, w_ref, block_expert_ref, row_token_ref, row_weight_ref, pair_row_ref, *,
                  pairs: int, k: int, experts: int, block_m: int, num_blocks: int, chunk: int):
  ep = _pow2(experts)
  e_iota = lax.broadcasted_iota(jnp.int32, (1, ep), 1)
  c_iota = lax.broadcasted_iota(jnp.int32, (chunk,), 0)
  earlier = c_iota[None, :] < c_iota[:, None]                                  # [C (pair), C (earlier pair)]

  def load_pairs(c):
    p = c * chunk + c_iota
    live = p < pairs
    ids = pltriton.load(ids_ref.at[p], mask=live, other=-1)
    kept = live & (ids >= 0) & (ids < experts)
    return p, jnp.where(kept, ids, -1), kept

  me = pl.program_id(0)
  p, ids, kept = load_pairs(me)                                                # this program's pairs (step 3)
  w = pltriton.load(w_ref.at[p], mask=kept, other=0.0).astype(jnp.float32)
  # 1. the per-expert counts of all pairs and of the pairs in chunks before this program's. Every chunk's load is
  # issued before any compute (the reductions' barriers would otherwise serialise one memory round trip a chunk),
  # and the one-hots are summed elementwise, with one column sum at the end instead of one a chunk
  chunks = [load_pairs(c)[1] for c in range(-(-pairs // chunk))]
  all_hits = jnp.zeros((chunk, ep), jnp.int32)
  earlier_hits = jnp.zeros((chunk, ep), jnp.int32)
  for c, chunk_ids in enumerate(chunks):
    hit = (chunk_ids[:, None] == e_iota).astype(jnp.int32)                    # [C, E']
    all_hits = all_hits + hit
    earlier_hits = earlier_hits + jnp.where(c < me, hit, 0)
  count = jnp.sum(all_hits, axis=0, keepdims=True)                             # [1, E']
  before = jnp.sum(earlier_hits, axis=0, keepdims=True)
  # 2. each expert's blocks
  blocks = (count + block_m - 1) // block_m                                    # [1, E']
  block_end = jnp.cumsum(blocks, axis=1)
  block_start = block_end - blocks
  n_used = jnp.sum(blocks)
  # 3. this program's pairs: row = expert's first row + count before the chunk + earlier same-expert pairs in it;
  # token and weight scattered there. Masked lanes index past the end (interpret mode writes a masked lane's old
  # value back, which must not land on an element another lane writes)
  rows_total = num_blocks * block_m
  onehot = ids[:, None] == e_iota                                              # [C, E']
  same = (ids[:, None] == ids[None, :]) & earlier                              # [C, C]
  row = (jnp.sum(jnp.where(onehot, block_start * block_m + before, 0), axis=1)
         + jnp.sum(same.astype(jnp.int32), axis=1))
  pltriton.store(pair_row_ref.at[p], jnp.where(kept, row, -1), mask=p < pairs)
  target = jnp.where(kept, row, rows_total)
  pltriton.store(row_token_ref.at[target], p // k, mask=kept)
  pltriton.store(row_weight_ref.at[target], w, mask=kept)
  # 4. this program's blocks: expert, and padding rows
  b_iota = lax.broadcasted_iota(jnp.int32, (BLOCK_CHUNK,), 0)
  m_iota = lax.broadcasted_iota(jnp.int32, (1, block_m), 1)
  b = me * BLOCK_CHUNK + b_iota
  live = b < num_blocks
  in_use = b < n_used
  expert = jnp.sum((block_end <= b[:, None]).astype(jnp.int32), axis=1)       # [BC]
  pltriton.store(block_expert_ref.at[b], jnp.where(in_use, expert, -1), mask=live)
  mine = expert[:, None] == e_iota                                             # [BC, E']
  # rows of the block that hold pairs: count - (b - first block) x block_m, one column sum
  fill = jnp.sum(jnp.where(mine, count + block_start * block_m, 0), axis=1) - b * block_m
  pad = live[:, None] & (~in_use[:, None] | (m_iota >= fill[:, None]))        # [BC, block_m]
  rows = jnp.where(pad, b[:, None] * block_m + m_iota, rows_total)
  pltriton.store(row_token_ref.at[rows], jnp.full(rows.shape, -1, jnp.int32), mask=pad)
  pltriton.store(row_weight_ref.at[rows], jnp.zeros(rows.shape, jnp.float32), mask=pad)


def supports(num_pairs: int, block_m: int) -> bool:
  """Whether align_kernel takes this many pairs (the static loops' reach) and this block size."""
  return 1 <= num_pairs <= MAX_PAIRS and block_m & (block_m - 1) == 0


def align_kernel(topk_ids: jax.Array, topk_weights: jax.Array, num_experts: int, block_m: int, *,
                 interpret: bool = False, num_warps: int = NUM_WARPS, pair_chunk: int = PAIR_CHUNK) -> Routing:
  """routing.align in one Pallas Triton launch (same Routing, to the bit). topk_ids int [T, K], topk_weights [T, K],
  T * K <= MAX_PAIRS, block_m a power of two. num_warps and pair_chunk (a power of two: pairs a program takes, and
  the one-hot's rows) are tuning knobs; any values give the same Routing."""
  t, k = topk_ids.shape
  p = t * k
  if not supports(p, block_m):
    raise ValueError(f"align_kernel: takes 1 to {MAX_PAIRS} pairs and a power-of-two block_m, got {p} pairs "
                     f"(T={t}, K={k}) and block_m={block_m}; use routing.align")
  if pair_chunk < 1 or pair_chunk & (pair_chunk - 1):
    raise ValueError(f"align_kernel: pair_chunk must be a power of two, got {pair_chunk}")
  chunk = min(int(pair_chunk), _pow2(p))
  nb = max(1, max_blocks(p, num_experts, block_m))
  whole = lambda shape: pl.BlockSpec(shape, lambda i: (0,) * len(shape))
  out_shape = [jax.ShapeDtypeStruct((nb,), jnp.int32), jax.ShapeDtypeStruct((nb * block_m,), jnp.int32),
               jax.ShapeDtypeStruct((nb * block_m,), jnp.float32), jax.ShapeDtypeStruct((p,), jnp.int32)]
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    block_expert, row_token, row_weight, pair_row = pl.pallas_call(
        functools.partial(_align_kernel, pairs=p, k=k, experts=int(num_experts), block_m=int(block_m),
                          num_blocks=nb, chunk=chunk),
        grid=(max(-(-p // chunk), -(-nb // BLOCK_CHUNK)),),
        in_specs=[whole((p,)), whole((p,))],
        out_specs=[whole(s.shape) for s in out_shape],
        out_shape=out_shape,
        interpret=bool(interpret),
        compiler_params=pltriton.CompilerParams(num_warps=int(num_warps), num_stages=1),
        name="w4a16_routing_align",
    )(topk_ids.reshape(-1).astype(jnp.int32), topk_weights.reshape(-1))
  return Routing(block_expert=block_expert, row_token=row_token, row_weight=row_weight,
                 pair_row=pair_row.reshape(t, k), block_m=int(block_m))
