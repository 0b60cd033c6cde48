"""Grouping (token, expert) pairs by expert for the grouped w4a16 MoE kernels, on the device, static shapes.

The T*K pairs of a top-K routing are sorted by expert (stable, so a token's order is kept) and each expert's run
is padded to a whole number of `block_m`-row blocks; a kernel program handles one block, i.e. one expert and at
most block_m of its tokens. The number of blocks is bounded statically by floor((P + (block_m - 1) U) / block_m)
for P = T*K pairs and U = min(E, P) experts that can be used (an expert with c pairs has ceil(c / block_m) <=
(c + block_m - 1) / block_m blocks; the bound is reached), so shapes never depend on the routing; blocks past
the ones in use carry expert -1 and their programs return at once. Experts with no token get no block, so their
weights are never read.

Expert ids outside [0, E) are dropped: such a pair gets no row and contributes 0. That is what an expert-parallel
shard needs (ids of experts that live on another device arrive out of range). A token that lists the same expert
twice gets two rows, each weighted by its own router weight, so its output holds that expert twice, as the sum
over k in the definition does.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.w4a16 import layout


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Routing:
  block_expert: jax.Array   # int32 [NB]: the expert of each block, -1 for blocks not in use
  row_token: jax.Array      # int32 [NB * block_m]: the token of each sorted row, -1 for padding rows
  row_weight: jax.Array     # float32 [NB * block_m]: the router weight of each row, 0 for padding rows
  pair_row: jax.Array       # int32 [T, K]: the sorted row of each (token, k) pair, -1 if its expert is dropped
  block_m: int = dataclasses.field(metadata=dict(static=True))

  @property
  def num_blocks(self) -> int:
    return self.block_expert.shape[0]


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
  """The most blocks any routing of num_pairs pairs over num_experts experts needs (module docstring). It sizes
  every [NB * block_m] array of the MoE (the gathered x rows, the kernels' outputs): at T = 16 / 64, top-8 of
  256, 8-row blocks, 128 / 288 blocks where ceil(P / block_m) + min(E, P) gave 144 / 320."""
  return (num_pairs + (block_m - 1) * min(num_experts, num_pairs)) // block_m


PAIRWISE_RANK_MAX_PAIRS = 4096


def pair_ranks(ids: jax.Array) -> jax.Array:
  """ids int32 [P] -> int32 [P]: how many earlier pairs (lower index) have the same id.

  Up to PAIRWISE_RANK_MAX_PAIRS pairs: one fused compare-and-count over the [P, P] pairs (at P = 512 on an H200
  under 5 µs; a cumsum over a [P, E] one-hot, which XLA lowers as a windowed reduction, took 105 µs). Above that
  (prefill), a stable argsort: the rank is the position in the sorted order minus the start of the id's run."""
  p = ids.shape[0]
  idx = jnp.arange(p, dtype=jnp.int32)
  if p <= PAIRWISE_RANK_MAX_PAIRS:
    earlier_same = (ids[None, :] == ids[:, None]) & (idx[None, :] < idx[:, None])           # [P (pair), P (earlier)]
    return jnp.sum(earlier_same, axis=1, dtype=jnp.int32)
  order = jnp.argsort(ids, stable=True)
  sorted_ids = ids[order]
  run_start = jnp.where(jnp.concatenate([jnp.ones((1,), bool), sorted_ids[1:] != sorted_ids[:-1]]), idx, 0)
  run_start = jax.lax.cummax(run_start, axis=0)                # the index where each sorted id's run begins
  return jnp.zeros((p,), jnp.int32).at[order].set(idx - run_start)


def align(topk_ids: jax.Array, topk_weights: jax.Array, num_experts: int, block_m: int) -> Routing:
  """topk_ids int [T, K], topk_weights [T, K] -> Routing (see the module docstring).

  No search: a pair's place in its expert's run is its rank among the earlier pairs of the same expert
  (pair_ranks), and a block's expert is the number of experts whose blocks end at or before it. On a GPU that is
  a handful of fused elementwise / reduce / scatter kernels; an argsort plus jnp.searchsorted (a loop of small
  kernels) cost ~0.3-0.5 ms per call at decode sizes on an H200."""
  t, k = topk_ids.shape
  p, e_count = t * k, num_experts
  nb = max(1, max_blocks(p, e_count, block_m))
  ids = topk_ids.reshape(-1).astype(jnp.int32)
  kept = (ids >= 0) & (ids < e_count)
  if t == 1 and k <= nb:
    return _align_one_token(ids, kept, topk_weights.reshape(-1), nb, block_m)
  count = jnp.sum(ids[:, None] == jnp.arange(e_count, dtype=jnp.int32)[None, :], axis=0, dtype=jnp.int32)  # [E]
  rank = pair_ranks(ids)
  blocks = -(-count // block_m)
  block_end = jnp.cumsum(blocks)                               # exclusive end, in blocks, per expert
  block_start = block_end - blocks
  n_used = block_end[-1]

  b = jnp.arange(nb, dtype=jnp.int32)
  in_use = b < n_used
  expert = jnp.sum(block_end[None, :] <= b[:, None], axis=1, dtype=jnp.int32)       # [NB]
  block_expert = jnp.where(in_use, jnp.minimum(expert, e_count - 1), -1)

  # each kept pair's row; rows of a block past its expert's count stay padding (-1 / weight 0)
  pe = jnp.clip(ids, 0, e_count - 1)
  row = block_start[pe] * block_m + rank
  pair_row = jnp.where(kept, row, -1)
  target = jnp.where(kept, row, nb * block_m)                  # dropped pairs: out of bounds, not written
  row_token = jnp.full((nb * block_m,), -1, jnp.int32).at[target].set(
      jnp.arange(p, dtype=jnp.int32) // k, mode="drop")
  row_weight = jnp.zeros((nb * block_m,), jnp.float32).at[target].set(
      topk_weights.reshape(-1).astype(jnp.float32), mode="drop")
  return Routing(block_expert=block_expert, row_token=row_token, row_weight=row_weight,
                 pair_row=pair_row.reshape(t, k).astype(jnp.int32), block_m=int(block_m))


def _align_one_token(ids, kept, weights, nb: int, block_m: int) -> Routing:
  """align for one token: a block per kept pair, in k order (its experts are distinct unless the router repeats
  one; a repeat gets a second block on the same expert, as align gives it a second row). Elementwise over the K
  pairs, no ranking or scatter: at decode batch 1 the general path's ~9 small kernels cost ~13 µs of the MoE's
  ~90 on an H200 (NOTES v10)."""
  k = ids.shape[0]
  place = jnp.cumsum(kept.astype(jnp.int32)) - 1                          # [K]: the block of each kept pair
  b = jnp.arange(nb, dtype=jnp.int32)
  match = kept[None, :] & (place[None, :] == b[:, None])                 # [NB, K]: block b holds pair k
  block_expert = jnp.where(match.any(axis=1), jnp.sum(jnp.where(match, ids[None, :], 0), axis=1), -1)
  block_weight = jnp.sum(jnp.where(match, weights[None, :].astype(jnp.float32), 0.0), axis=1)
  rows = jnp.arange(nb * block_m, dtype=jnp.int32)
  row_block = rows // block_m
  first = (rows % block_m == 0) & (block_expert[row_block] >= 0)        # each used block's one row
  return Routing(block_expert=block_expert.astype(jnp.int32), row_token=jnp.where(first, 0, -1),
                 row_weight=jnp.where(first, block_weight[row_block], 0.0),
                 pair_row=jnp.where(kept, place * block_m, -1).reshape(1, k).astype(jnp.int32), block_m=int(block_m))


def dense_blocks(m: int, min_block_m: int = 16) -> Routing:
  """The row blocks of a dense matmul of M rows for the grouped kernels: one "expert" (0), blocks of min_block_m
  (16, or 8 where the kernel takes it) / 16 / 32 / 64 rows (the smallest that holds M, up to 64), rows past M
  padding. pair_row is the identity [M, 1]. NumPy arrays: known when the program is traced, so what a kernel
  derives from them (mosaic_sm90's block counts) is a constant, not a kernel of its own."""
  block_m = next((b for b in (8, 16, 32) if b >= min_block_m and m <= b), 64)
  nb = -(-m // block_m)
  rows = np.arange(nb * block_m, dtype=np.int32)
  return Routing(block_expert=np.zeros((nb,), np.int32), row_token=np.where(rows < m, rows, -1).astype(np.int32),
                 row_weight=np.ones((nb * block_m,), np.float32),
                 pair_row=np.arange(m, dtype=np.int32)[:, None], block_m=block_m)


def in_place_rows(routing: Routing) -> jax.Array:
  """row_token for a second grouped matmul that reads the first one's output rows where they are: row r is
  output row r (valid where the first call's row_token >= 0), -1 on padding rows."""
  rows = jnp.arange(routing.row_token.shape[0], dtype=jnp.int32)
  return jnp.where(routing.row_token >= 0, rows, -1)


def k_splits(n_chunks: int, programs: int, target: int) -> int:
  """K splits so that about `target` programs run (never more splits than chunks), as few as give the same
  chunks per split."""
  want = max(1, -(-target // max(programs, 1)))
  s = min(want, n_chunks)
  return -(-n_chunks // -(-n_chunks // s))


def balanced_k_splits(n_chunks: int, units: int, ctas: int, partial_chunks: float) -> int:
  """K splits for a persistent grid of `ctas` CTAs that walk `units` (block, column tile) units round-robin: the
  split count that minimises the busiest CTA's work, ceil(units s / ctas) chunks-per-split chunks, plus
  partial_chunks per split past the first (the float32 partial sums written and read back, in chunk-equivalents
  of one CTA's time). Fewer splits on ties. E.g. the MoE down projection at T = 1 (8 blocks x 56 column tiles of
  8 chunks on 132 CTAs): unsplit the busiest CTA runs 4 units = 32 chunks against a mean of 27.2; two splits of 4
  chunks give 7 x 4 = 28."""
  def cost(s):
    cps = -(-n_chunks // s)
    s = -(-n_chunks // cps)
    return -(-units * s // ctas) * cps + partial_chunks * (s - 1), s
  return min((cost(s) for s in range(1, n_chunks + 1)), key=lambda c: c[0])[1]


def stream_k_plan(units: int, n_chunks: int, ctas: int):
  """Stream-K over `units` work units of n_chunks chunks each, laid end to end: CTA c takes chunks [c L, c L + L),
  L = ceil(units n_chunks / ctas), so no CTA runs more than one chunk above the mean, and a unit's chunks end up in
  1, 2, ... segments on consecutive CTAs. Returns (L, S = the most segments of any unit, valid [S, units] bool:
  whether unit t has a segment k, i.e. whether slot k of its partial sums is written)."""
  per_cta = -(-units * n_chunks // ctas)
  t = np.arange(units)
  segments = ((t + 1) * n_chunks - 1) // per_cta - (t * n_chunks) // per_cta + 1
  most = int(segments.max())
  return per_cta, most, np.arange(most)[:, None] < segments[None, :]


def dense_matmul(grouped_matmul, x: jax.Array, w: layout.W4A16Weight, *, config: dict, interpret: bool,
                 out_dtype, min_block_m: int = 16, reads_x_in_place: bool = False) -> jax.Array:
  """x [M, K] @ W [K, N] through a grouped kernel (triton.grouped_matmul or mosaic_sm90.grouped_matmul): W as a
  one-expert stack, M rows in dense_blocks. reads_x_in_place: the kernel takes x_in_block_order, used where M
  fills its blocks exactly (x's rows are then the blocks' rows, and the copy into block order is skipped)."""
  m = x.shape[0]
  blocks = dense_blocks(m, min_block_m)
  in_place = reads_x_in_place and m == blocks.row_token.shape[0]
  y = grouped_matmul(x, layout.as_stack(w), blocks.block_expert, blocks.row_token, blocks.row_weight,
                     block_m=blocks.block_m, gated=False, weighted=False, out_dtype=out_dtype or x.dtype,
                     busy_blocks=blocks.num_blocks, interpret=interpret, config=config,
                     **(dict(x_in_block_order=True) if in_place else {}))
  return y[:m, :w.n]


def combine(rows: jax.Array, routing: Routing, *, apply_weights: bool = False) -> jax.Array:
  """rows [NB*block_m, D] (or K-split partials [S, NB*block_m, D], summed here: one fusion with the gather
  instead of a pass over every row) -> [T, D]: the sum over each token's k pairs, in float32. apply_weights:
  multiply each row by its router weight here (for kernels that did not weight their rows)."""
  pr = routing.pair_row                                        # [T, K]
  idx = jnp.maximum(pr, 0).reshape(-1)
  if rows.ndim == 3:
    got = jnp.take(rows, idx, axis=1).astype(jnp.float32).sum(axis=0)
  else:
    got = jnp.take(rows, idx, axis=0).astype(jnp.float32)
  got = got.reshape(*pr.shape, rows.shape[-1])
  if apply_weights:
    # row_weight gathered back, not the caller's topk_weights: XLA fuses a model router's weight arithmetic into
    # this [T, K, D] fusion and recomputes it per element (V3 slice, T = 64, H200: the combine 8 -> 143 µs);
    # row_weight's scatter is a fusion boundary
    got = got * jnp.take(routing.row_weight, jnp.maximum(pr, 0))[..., None]
  got = jnp.where((pr >= 0)[..., None], got, 0.0)              # dropped pairs: never read a row
  return got.sum(axis=1)


def uniform_random(key, t: int, e: int, k: int):
  """Uniform random top-k (distinct experts per token) and weights."""
  ks, kw = jax.random.split(key)
  ids = jnp.argsort(jax.random.uniform(ks, (t, e)), axis=1)[:, :k].astype(jnp.int32)
  return ids, jax.random.uniform(kw, (t, k), jnp.float32, 0.05, 0.3)
