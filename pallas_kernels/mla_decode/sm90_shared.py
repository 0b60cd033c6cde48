"""What the two mosaic_sm90 kernels (swapped: mosaic_sm90.py, rows: mosaic_sm90_rows.py) share.

- The split-KV share a CTA owns (`share_of_part`) and the producer warpgroup that streams its pages by TMA through the
  block table into the SMEM ring (`produce_pages`).
- The register layouts for dequantizing an fp8 page (e4m3 -> f16 x tile scale). Both describe tiles whose row count
  is a multiple of 32: the swapped kernel dequantizes [64 tok, 128] tiles, the rows kernel [32 tok, 128] tiles (each
  compute warpgroup its own half of the page's tokens).
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu


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
                  loaded, consumed, stages: int, num_pages: int, half: int):
  """The producer warpgroup's body: every page of the share, in order, by TMA into ring slot c % stages (latent as
  two column halves, rope, and the fp8 scales when sc_ref is given), after the compute warpgroups released that slot
  (`consumed`); each slot's copies arrive on `loaded[slot]`. Table entries are clipped to the pool, so a bad entry
  cannot fault (the api NaNs that row)."""
  plgpu.set_max_registers(40, action="decrease")

  def seg(b, ctr):
    lo, hi = seq_pages(b)

    def page(j, c):
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


def dequant_layout():
  """Register layout of a [32k tok, 128] tile in the dequant pass: 8 consecutive elements per thread (one 8-byte
  fp8 load, one 16-byte f16 store, both whole swizzle chunks) -- Mosaic's SMEM copy layout for 16-bit 64-wide
  tiles. The wgmma layout would move 2 elements per SMEM access, 4x the instructions."""
  return plgpu.Layout.TILED(plgpu.Tiling(((32, 64), (8, 64), (4, 64), (8,))), warp_dims=(-7,),
                            lane_dims=(-3, -2), vector_dim=-1)


def scale_layout():
  """Register layout for a page's fp8 scales [32k tok, 4]: each thread holds the 4 scales of every row it owns
  in dequant_layout(), so `.sum(axis=1)` of a one-hot select is a per-row vector in dequant_layout().reduce(1)
  (a reduction inside each thread: no cross-warp scratch)."""
  return plgpu.Layout.TILED(plgpu.Tiling(((32, 4), (8, 4), (4, 4))), warp_dims=(-6,),
                            lane_dims=(-2, plgpu.Replicated(8)), vector_dim=-1)
