"""What the two mosaic_sm90 kernels (swapped: mosaic_sm90.py, rows: mosaic_sm90_rows.py) share.

- The split-KV share a CTA owns (`share_of_part`) and the producer warpgroup that streams its pages by TMA through the
  block table into the SMEM ring (`produce_pages`).
- The register layouts for dequantizing an fp8 page (e4m3 -> f16 x tile scale). Both describe tiles whose row count
  is a multiple of 32: the swapped kernel dequantizes [64 tok, 128] tiles, the rows kernel [32 tok, 128] tiles (each
  compute warpgroup its own half of the page's tokens).
"""
from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
from jax.experimental.mosaic import gpu as mgpu
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import llvm, vector


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


# ---- e4m3 -> f16 on the integer pipe ---------------------------------------------------------------------------
# An e4m3 byte b = s eeee mmm read as f16 bits s 0eeee mmm0000000 is exactly b's value x 2^-8 (f16's exponent bias
# is 8 more than e4m3's; e4m3 subnormals land on f16 subnormals, 2^-17 and up, exact). Per pair of bytes: one prmt
# builds two 16-bit lanes (sign-replicated byte above the byte), one shl by 7 and one and (0xBF80 a lane) leave
# the sign at bit 15 and the 7 low bits at 7..13. Three integer instructions a pair instead of one cvt on the
# conversion pipe (Mosaic lowers astype(f16) to cvt.rn.f16x2.e4m3x2), so a dequant can spread its conversions over
# both pipes. e4m3's NaN codes (0x7F, 0xFF) come out as +-480 x 2^-8, not NaN: the cache writer saturates and
# never stores them.
E4M3_F16_BIAS = 256.0          # what the bit pattern's value is multiplied by


def _e4m3_pair_asm(selector: int) -> str:
  return ("{\n.reg .b32 t;\n" f"prmt.b32 t, $1, $1, {selector:#06x};\n" "shl.b32 t, t, 7;\n"
          "and.b32 $0, t, 0xBF80BF80;\n}")


@functools.lru_cache(maxsize=None)
def _e4m3_bits_gpu(shape: tuple[int, ...]):
  out_type = plgpu.ShapeDtypeStruct(shape, jnp.float16, layout=dequant_layout())

  @plgpu.inline_mgpu(arg_types=(dequant_layout(),), return_type=out_type)
  def convert(_ctx, x):
    i32 = ir.IntegerType.get_signless(32)
    regs = np.empty(x.registers.shape, dtype=object)
    for idx in np.ndindex(*x.registers.shape):
      reg = x.registers[idx]                                      # vector<8 x f8E4M3FN>: 8 consecutive columns
      n = ir.VectorType(reg.type).shape[0]
      words = vector.bitcast(ir.VectorType.get((n // 4,), i32), reg)
      out = []
      for k in range(n // 4):
        w = vector.extract(words, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([k]))
        # bytes (0, 1) -> lanes of the first f16x2 word, bytes (2, 3) -> the second; 8 + byte = its sign
        out += [llvm.inline_asm(i32, [w], _e4m3_pair_asm(sel), "=r,r") for sel in (0x9180, 0xB3A2)]
      vec = vector.from_elements(ir.VectorType.get((len(out),), i32), out)
      regs[idx] = vector.bitcast(ir.VectorType.get((n,), ir.F16Type.get()), vec)
    return mgpu.FragmentedArray(_registers=regs, _layout=x.layout, _is_signed=None)

  return convert


def e4m3_bits_jnp(x):
  """The same bit construction in jax.numpy (interpret mode; tests): e4m3 array -> f16 = value x 2^-8."""
  b = lax.bitcast_convert_type(x, jnp.uint8).astype(jnp.uint16)
  lanes = b | jnp.where(b >= 128, jnp.uint16(0xFF00), jnp.uint16(0))
  return lax.bitcast_convert_type((lanes << 7) & jnp.uint16(0xBF80), jnp.float16)


def e4m3_to_f16(x, *, integer: bool, on_gpu: bool):
  """An e4m3 tile in dequant_layout() -> f16, exact either way: cvt (integer False) or the integer-pipe bits x 2^8."""
  if not integer:
    return x.astype(jnp.float16)
  bits = _e4m3_bits_gpu(tuple(x.shape))(x) if on_gpu else e4m3_bits_jnp(x)
  return bits * jnp.float16(E4M3_F16_BIAS)
