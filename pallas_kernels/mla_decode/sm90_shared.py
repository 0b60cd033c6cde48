"""What the three mosaic_sm90 kernels (swapped: mosaic_sm90.py, rows: mosaic_sm90_rows.py, seesaw:
mosaic_sm90_seesaw.py) share.

- The split-KV share a CTA owns (`share_of_part`) and the producer warpgroup that streams its pages by TMA through the
  block table into the SMEM ring (`produce_pages`).
- The register layouts for dequantizing an fp8 page (e4m3 -> f16 x tile scale). Both describe tiles whose row count
  is a multiple of 32: the swapped kernel dequantizes [64 tok, 128] tiles, the rows and seesaw kernels [32 tok, 128]
  tiles (`scaled_f16`), and the 64-row kernels' Q in f16 (`start_q_latent`).
- The 16-bit SMEM tile transforms (`SWZ16`).
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels.mla_decode.cache import ROPE_DIM

from pallas_kernels.mla_decode.cache import FP8_TILE
from pallas_kernels.sm90_registers import check_register_split

# registers a thread of the TMA producer (produce_pages) and of each of the two compute warpgroups beside it, in the
# swapped kernel without producer_dequant and in the rows kernel: three warpgroups' 504 exactly
TMA_PRODUCER_REGISTERS, COMPUTE_REGISTERS = 40, 232
check_register_split([TMA_PRODUCER_REGISTERS, COMPUTE_REGISTERS, COMPUTE_REGISTERS], "mla_decode sm90 defaults")


def share_of_part(sched_ref, cu_ref, part):
  """(b_first, b_last, seq_pages) of split-KV share `part` (split_kv.schedule_kernel's rows: begin, end, b_first,
  b_last); seq_pages(b) -> the share's page range [lo, hi) within sequence b (empty when hi <= lo)."""
  begin, end, b_first, b_last = (sched_ref[i, part] for i in range(4))

  def seq_pages(b):
    cb = cu_ref[b]
    cb1 = cu_ref[b + 1]
    return jnp.maximum(begin, cb) - cb, jnp.minimum(end, cb1) - cb

  return b_first, b_last, seq_pages


def produce_pages(*, b_first, b_last, seq_pages, bt_ref, lat_ref, rope_ref, sc_ref, ring_lat, ring_rope, ring_sc,
                  loaded, consumed, stages: int, num_pages: int, half: int, l2_prefetch: int = 0,
                  registers: int = TMA_PRODUCER_REGISTERS):
  """The producer warpgroup's body: every page of the share, in order, by TMA into ring slot c % stages (latent as
  two column halves, rope, and the fp8 scales when sc_ref is given), after the compute warpgroups released that slot
  (`consumed`); each slot's copies arrive on `loaded[slot]`. Table entries are clipped to the pool, so a bad entry
  cannot fault (the api NaNs that row). l2_prefetch: that many pages of the segment ahead of the one being copied
  are asked into L2 (TMA prefetch), so a copy that waited for its slot finds its page there (0: off). registers:
  what this warpgroup gives back to (setmaxnreg) for the compute warpgroups beside it."""
  plgpu.set_max_registers(registers, action="decrease")

  def prefetch(b, j, hi):
    @pl.when(j < hi)
    def _():
      pg = page_ahead(bt_ref, b, j, num_pages)
      for w in range(2):                  # (a TMA box is at most 256 elements a dimension)
        plgpu.async_prefetch(lat_ref.at[pg, :, pl.ds(w * half, half)])
      plgpu.async_prefetch(rope_ref.at[pg])
      if sc_ref is not None:
        plgpu.async_prefetch(sc_ref.at[pg])

  def seg(b, ctr):
    lo, hi = seq_pages(b)
    for k in range(l2_prefetch):
      prefetch(b, lo + k, hi)

    def page(j, c):
      if l2_prefetch:
        prefetch(b, j + l2_prefetch, hi)
      slot = lax.rem(c, stages)

      @pl.when(c >= stages)
      def _():
        plgpu.barrier_wait(consumed.at[slot])

      pg = jnp.clip(bt_ref[b, j], 0, num_pages - 1)
      for w in range(2):
        plgpu.copy_gmem_to_smem(lat_ref.at[pg, :, pl.ds(w * half, half)], ring_lat.at[slot, w], loaded.at[slot])
      plgpu.copy_gmem_to_smem(rope_ref.at[pg], ring_rope.at[slot], loaded.at[slot])
      if sc_ref is not None:
        plgpu.copy_gmem_to_smem(sc_ref.at[pg], ring_sc.at[slot], loaded.at[slot])
      return c + 1

    return lax.fori_loop(lo, jnp.maximum(lo, hi), page, ctr)

  done = lax.fori_loop(b_first, b_last + 1, seg, jnp.int32(0))
  # observe the release of the last pages too, so no barrier phase is left pending at exit
  for i in range(stages):
    @pl.when(done + i >= stages)
    def _():
      plgpu.barrier_wait(consumed.at[lax.rem(done + i, stages)])


def reduce_rows(op: str, x, scratch):
  """x [64, n] f32 in the WGMMA layout reduced over its 64 rows ("max" or "add") -> [n] in WGMMA.reduce(0), its
  cross-warp step through `scratch` (an f32 [k] SMEM ref, k >= n * 16) instead of the one region Mosaic keeps for
  the whole CTA: warpgroups running the same code reduce independently, each through a region of its own."""
  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType()),
                     return_type=plgpu.ShapeDtypeStruct((x.shape[1],), x.dtype, layout=plgpu.Layout.WGMMA.reduce(0)))
  def reduce(_ctx, v, ref):
    return v.reduce(op, 0, scratch=ref)

  return reduce(x, scratch)


def dequant_layout():
  """Register layout of a [32k tok, 128] tile in the dequant pass: 8 consecutive elements per thread (one 8-byte
  fp8 load, one 16-byte f16 store, both whole swizzle chunks) -- Mosaic's SMEM copy layout for 16-bit 64-wide
  tiles. The wgmma layout would move 2 elements per SMEM access, 4x the instructions."""
  return plgpu.Layout.TILED(plgpu.Tiling(((32, 64), (8, 64), (4, 64), (8,))), warp_dims=(-7,),
                            lane_dims=(-3, -2), vector_dim=-1)


# a 16-bit [.., 64k] SMEM tile in 128-byte swizzled rows: Q, the f16 / bf16 pages, P (every sm90 MLA kernel)
SWZ16 = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))


def scale_layout():
  """Register layout for a page's fp8 scales [32k tok, 4]: each thread holds the 4 scales of every row it owns
  in dequant_layout(), so `.sum(axis=1)` of a one-hot select is a per-row vector in dequant_layout().reduce(1)
  (a reduction inside each thread: no cross-warp scratch)."""
  return plgpu.Layout.TILED(plgpu.Tiling(((32, 4), (8, 4), (4, 4))), warp_dims=(-6,),
                            lane_dims=(-2, plgpu.Replicated(8)), vector_dim=-1)


CONVERT_TOKENS = 32            # tokens of an fp8 conversion unit (half a page)


def page_ahead(bt_ref, b, j, num_pages: int):
  """Pool page of page j of sequence b for a producer that reads the table ahead: j clipped into the table and the
  page into the pool, so a read past the sequence's end cannot fault (its page is never loaded or prefetched)."""
  return jnp.clip(bt_ref[b, jnp.clip(j, 0, bt_ref.shape[1] - 1)], 0, num_pages - 1)


def check_l2_prefetch(value, limit: int, unit: str) -> int:
  """A producer's l2_prefetch setting (its make_plan resolved None to its default): an int in [0, limit] (of
  `unit`s ahead; 0: off)."""
  if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= limit:
    raise ValueError(f"l2_prefetch is a number of {unit} in [0, {limit}] (0: off), got {value!r}")
  return value


def load_fp8_part(lat_ref, sc_ref, pg, half: int, col_tiles=None):
  """For a producer that converts pages itself: the e4m3 tiles of latent half `half` (columns [256 half, 256 half
  + 256)) of pool page pg straight from GMEM, {(t, th): [32 tok, 128] column tile t of token half th} (8 bytes a
  thread each), and their scales {th: [32, 4]}. Issued before the caller waits for the slot, so that
  their latency passes under the wait. col_tiles: only these column tiles of the half (None: both)."""
  tok, tile = CONVERT_TOKENS, FP8_TILE
  col_tiles = (2 * half, 2 * half + 1) if col_tiles is None else col_tiles
  tiles = {(t, th): plgpu.load(lat_ref.at[pg, pl.ds(th * tok, tok), pl.ds(t * tile, tile)],
                               layout=dequant_layout(), optimized=False)
           for t in col_tiles for th in (0, 1)}
  scales = {th: plgpu.load(sc_ref.at[pg, pl.ds(th * tok, tok)], layout=scale_layout(), optimized=False)
            for th in (0, 1)}
  return tiles, scales


def convert_fp8_part(part, half: int, n_valid, store, col_tiles=None):
  """load_fp8_part's (tiles, scales) -> f16 x each tile's power-of-two scale (exact), handed to store(x, t, th)
  tile by tile ([32 tok, 128] f16 in dequant_layout: column tile t, token half th). Tokens at or past n_valid (a
  partial last page) -> 0 by select: they may hold NaN; only such a page pays the select. col_tiles: only these
  column tiles of the part (None: both)."""
  tiles, scales = part
  col_tiles = (2 * half, 2 * half + 1) if col_tiles is None else col_tiles

  def convert(masked: bool):
    for th in (0, 1):
      col4 = plgpu.broadcasted_iota(jnp.int32, (CONVERT_TOKENS, 4), 1, layout=scale_layout())
      if masked:
        row4 = plgpu.broadcasted_iota(jnp.int32, (CONVERT_TOKENS, 4), 0, layout=scale_layout())
        ok = (row4 + th * CONVERT_TOKENS < n_valid).astype(jnp.float32)
      for t in col_tiles:
        store(scaled_f16(tiles[t, th], scales[th], col4, t, ok if masked else None), t, th)

  page = 2 * CONVERT_TOKENS
  pl.when(n_valid >= page)(lambda: convert(False))
  pl.when(n_valid < page)(lambda: convert(True))


def scaled_f16(x, sc, col4, t: int, ok=None):
  """An e4m3 [32k tok, 128] tile (dequant_layout) that is column tile t of its page -> f16 x its rows' scales (a
  power of two: exact). sc: the rows' [32k, 4] scales and col4 their column iota (scale_layout); ok: 1.0 for the
  rows to keep, where the others -> 0 by select (tokens past a length may hold NaN), None: keep all."""
  s_t = jnp.where(col4 == t, sc, 0.0).sum(axis=1).astype(jnp.float16)
  x = x.astype(jnp.float16) * lax.broadcast_in_dim(s_t, x.shape, [0])
  if ok is not None:
    ok_t = jnp.where(col4 == t, ok, 0.0).sum(axis=1)
    x = jnp.where(lax.broadcast_in_dim(ok_t, x.shape, [0]) > 0, x, jnp.zeros_like(x))
  return x


def q_rope_of(qr_ref, bg):
  """Q's rope part [rows, 64] of row block bg: the last 64 columns of its operand, which is q whole [.., 576] (the
  kernel reads both parts from it where they are) or q_rope alone [.., 64]."""
  return qr_ref.at[bg, :, pl.ds(qr_ref.shape[-1] - ROPE_DIM, ROPE_DIM)]


def start_q_latent(q_ref, bg, q_smem, qbar, w: int, fp8: bool, half: int):
  """Q's latent part of row block bg into q_smem [2 halves, 64, half] at a segment start, arriving on qbar (2
  arrivals). fp8 cache: each compute warpgroup w converts its half, bf16 in GMEM, to f16 (the pages are f16; the
  same rounding as an XLA cast, without writing an f16 copy of q first); bf16: warpgroup 0 copies both halves by
  TMA. The caller has made sure both warpgroups are done with the previous Q."""
  tile = 128
  if fp8:
    for c in range(half // tile):
      x = plgpu.load(q_ref.at[bg, :, pl.ds(w * half + c * tile, tile)], layout=dequant_layout(), optimized=False)
      q_smem[w, :, pl.ds(c * tile, tile)] = x.astype(jnp.float16)
    plgpu.commit_smem()               # visible to both warpgroups' wgmmas after qbar
    plgpu.barrier_arrive(qbar)
  elif w == 0:
    plgpu.commit_smem()
    for h in range(2):
      plgpu.copy_gmem_to_smem(q_ref.at[bg, :, pl.ds(h * half, half)], q_smem.at[h], qbar)
