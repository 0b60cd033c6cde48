"""Row copies for the Hopper MoE kernel: x rows into expert-block order, writing only the valid rows.

The grouped kernel reads a block's x tile with one TMA copy, so x must sit in block order, [NB * block_m, K]. An
XLA gather (`mosaic_sm90.block_rows`) writes every one of those rows although most are padding: at T = 16 / 64
tokens, top-8 of 256 experts, 8-row blocks, 1,024 / 2,304 rows for 128 / 512 valid ones (16.5 / 37 MB written,
10.9 / 22.8 µs on an H200 before the static block bound was tightened, 6dee080). The kernel reads padding rows
but a token is one wgmma column, so their values reach only padding outputs, which are never stored: they may be
garbage. copy_rows copies listed rows GMEM -> SMEM -> GMEM with TMA, one CTA per listed row, and leaves every
other row of its outputs unwritten: with one entry per (token, expert) pair (source: the token's row, destination:
the pair's row in block order) only the valid rows are written and no CTA is idle.

Several arrays with the same rows go in one call (x and the fma fold's per-group sums of x). Each [T, C] array is
copied as [1, C / W, W] boxes (W = the widest power of two <= 256 dividing C, at least 16 bytes wide: TMA's box
limits), so C must be a multiple of 16 bytes' worth of elements.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu


SMEM_BYTES = 227 * 1024


def _box_width(cols: int, itemsize: int) -> int:
  for w in (256, 128, 64, 32, 16, 8):
    if cols % w == 0 and w * itemsize >= 16:
      if cols // w > 256:
        raise ValueError(f"copy_rows: {cols} columns are more than a TMA box holds (256 x {w}).")
      return w
  raise ValueError(f"copy_rows: {cols} columns of {itemsize}-byte elements are not a multiple of 16 bytes.")


@functools.lru_cache(maxsize=None)
def _copy_call(copies: int, out_rows: int, shapes: tuple, dtypes: tuple, interpret: bool):
  n = len(shapes)
  widths = [_box_width(c, jnp.dtype(d).itemsize) for (_, c), d in zip(shapes, dtypes)]
  boxes = [(1, c // w, w) for (_, c), w in zip(shapes, widths)]

  def body(src_row_ref, dst_row_ref, *refs):
    srcs, dsts, bufs, loaded = refs[:n], refs[n:2 * n], refs[2 * n:3 * n], refs[3 * n]
    i = lax.axis_index("i")
    src_row, dst_row = src_row_ref[i], dst_row_ref[i]

    @pl.when((src_row >= 0) & (dst_row >= 0))
    def _():
      for src, buf in zip(srcs, bufs):
        plgpu.copy_gmem_to_smem(src.at[pl.ds(src_row, 1)], buf, loaded)
      plgpu.barrier_wait(loaded)
      for buf, dst in zip(bufs, dsts):
        plgpu.copy_smem_to_gmem(buf, dst.at[pl.ds(dst_row, 1)])
      plgpu.wait_smem_to_gmem(0)

  out_type = [jax.ShapeDtypeStruct((out_rows, *box[1:]), d) for box, d in zip(boxes, dtypes)]
  scratch = [plgpu.SMEM(box, d) for box, d in zip(boxes, dtypes)] + [plgpu.Barrier(num_arrivals=n)]
  kernel = plgpu.kernel(body, out_type=out_type, scratch_types=scratch, grid=(copies,), grid_names=("i",),
                        interpret=plgpu.InterpretGPUParams() if interpret else False)

  def call(src_row, dst_row, *arrays):
    outs = kernel(src_row, dst_row, *[a.reshape(a.shape[0], *box[1:]) for a, box in zip(arrays, boxes)])
    return [o.reshape(out_rows, -1) for o in outs]

  return call


def copy_rows(arrays, src_row: jax.Array, dst_row: jax.Array, out_rows: int, *,
              interpret: bool = False) -> list[jax.Array]:
  """arrays: [T, C_i] each -> [out_rows, C_i] each: for every i with src_row[i] >= 0 and dst_row[i] >= 0, output
  row dst_row[i] is arrays[..][src_row[i]]; rows no copy writes are never written (whatever the memory held).
  Destinations must be distinct."""
  arrays = list(arrays)
  if not arrays or any(a.ndim != 2 or a.shape[0] != arrays[0].shape[0] for a in arrays):
    raise ValueError("copy_rows: give one or more 2-D arrays with the same number of rows.")
  if src_row.shape != dst_row.shape or src_row.ndim != 1:
    raise ValueError(f"copy_rows: src_row {src_row.shape} and dst_row {dst_row.shape} must be one 1-D shape.")
  if sum(a.shape[1] * a.dtype.itemsize for a in arrays) > SMEM_BYTES:
    raise ValueError(f"copy_rows: one row of every array ({[a.shape[1] for a in arrays]} columns) must fit in "
                     f"{SMEM_BYTES} bytes of shared memory.")
  call = _copy_call(int(src_row.shape[0]), int(out_rows), tuple(a.shape for a in arrays),
                    tuple(a.dtype for a in arrays), bool(interpret))
  return call(src_row.astype(jnp.int32), dst_row.astype(jnp.int32), *arrays)


def gather_rows(arrays, row_token: jax.Array, *, interpret: bool = False) -> list[jax.Array]:
  """arrays: [T, C_i] each -> [R, C_i] each, R = row_token's length: row r is arrays[i][row_token[r]] where
  row_token[r] >= 0; the other rows are never written (whatever the memory held)."""
  rows = row_token.shape[0]
  return copy_rows(arrays, row_token, jnp.arange(rows, dtype=jnp.int32), rows, interpret=interpret)
