"""Register layouts shared by the two mosaic_sm90 kernels for dequantizing an fp8 page (e4m3 -> f16 x tile scale).

Both describe tiles whose row count is a multiple of 32: the swapped kernel dequantizes [64 tok, 128] tiles, the rows
kernel [32 tok, 128] tiles (each compute warpgroup its own half of the page's tokens).
"""
from __future__ import annotations

import jax.experimental.pallas.mosaic_gpu as plgpu


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
