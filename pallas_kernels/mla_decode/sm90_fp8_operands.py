"""e4m3 page -> f16 wgmma A operands in registers, for the swapped kernel's `register_dequant` (fp8 cache).

No f16 copy of the page exists: the compute warpgroup reads the TMA'd e4m3 bytes from shared memory, 16 (QK) or
8 (P.V) consecutive bytes a thread per load, and turns them into the A registers of its two products:

    S^T [64 tok, N] = K [64 tok, 512] . Q^T      A rows: tokens; K: latent dims, permuted within each 64-dim chunk
    O^T [512, N]   += V^T [512, 64 tok] . P^T    A rows: latent dims, permuted over the whole half; K: tokens

A wgmma A fragment gives lane (g, c) of warp w rows 16 w + g and 16 w + g + 8 and, in each 16-wide k-step, columns
2c, 2c+1, 2c+8, 2c+9. Both products are free to permute the dims they run over, so the permutations below put
every byte a thread needs for a token (QK) or for a pair of tokens (P.V) next to each other in shared memory:
- QK: logical column k = 16 j + 8 eh + 2 c + el of a 64-dim chunk is page dim 16 c + 4 j + 2 eh + el of that
  chunk; Q's latent part is permuted the same way (`qk_dims`), so S^T is unchanged. One 16-byte load of a token's
  row gives a thread its four k-steps of that chunk.
- P.V: A row r = 16 w + g + 8 h of M-block b' of latent half H is dim 256 H + 64 w + 8 g + 2 b' + h. One 8-byte
  load at token t gives a thread its rows of all four blocks of the half; a pair of tokens' loads make, by one
  byte permute, the (t, t+1) pairs of two rows. O^T comes out with its rows in that order and the merge kernel
  gathers them in dim order (`pv_rows`, `row_of_dim`).
Scales (one a token and 128-dim tile, powers of two) multiply the f16 pairs (exact). Only e4m3 -> f16 exists on
this ptxas (`cvt.rn.f16x2.e4m3x2`), hence f16 products as in the rest of the fp8 path.

The register maps come from the layouts' tilings (`register_owners`, NumPy) and are checked for every thread:
each inline conversion below assumes one map for all 128 threads.
"""
from __future__ import annotations

import functools

import numpy as np
import jax
import jax.numpy as jnp
import jax.experimental.pallas.mosaic_gpu as plgpu
from jax.experimental.mosaic import gpu as mgpu
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, llvm, memref, vector

from pallas_kernels.mla_decode.cache import FP8_TILE, LATENT_DIM
from pallas_kernels.sm90_registers import register_owners

PAGE = 64
HALF = LATENT_DIM // 2
CHUNK = 64                 # dims of one QK A array (4 k-steps)
BLOCK = 64                 # dims of one P.V M-block


def _tiled_layout(tiles, warp_dims, lane_dims, vector_dim):
  """plgpu TILED layout of Mosaic's canonical form of this tiling (Mosaic refuses a non-canonical one; the tilings
  below read more easily with their unit tiles spelled out)."""
  m = mgpu.TiledLayout(mgpu.fragmented_array.Tiling(tiles), warp_dims=warp_dims, lane_dims=lane_dims,
                       vector_dim=vector_dim, _check_canonical=False).canonicalize()
  return plgpu.Layout.TILED(plgpu.Tiling(m.tiling.tiles), warp_dims=m.warp_dims, lane_dims=m.lane_dims,
                            vector_dim=m.vector_dim)


# [64 tok, 128 dims] e4m3 (one scale tile): lane (g, c) of warp w holds rows 16 w + g (+ 8) and bytes
# 64 q + 16 c .. + 15 of each 64-dim chunk q, one 16-byte vector each (4 registers).
QK_TILE_LAYOUT = _tiled_layout(((64, 128), (64, 64), (16, 64), (8, 64), (1, 16)),
                               warp_dims=(-8,), lane_dims=(-4, -3), vector_dim=-1)
# [64 tok, 256 dims] e4m3 (a latent half): lane (g, c) of warp w holds dims 64 w + 8 g .. + 7 at tokens
# 16 j + 8 eh + 2 c + el, one 8-byte vector each (16 registers).
PV_HALF_LAYOUT = _tiled_layout(((64, 256), (16, 256), (8, 256), (2, 256), (2, 64), (2, 8), (1, 8)),
                               warp_dims=(-7,), lane_dims=(-5, -10), vector_dim=-1)


def qk_dims() -> np.ndarray:
  """[512]: logical QK column i of the kernel's Q latent operand is latent dim qk_dims()[i]."""
  k = np.arange(LATENT_DIM)
  chunk, r = k // CHUNK, k % CHUNK
  j, eh, c, el = r // 16, (r // 8) % 2, (r // 2) % 4, r % 2
  return chunk * CHUNK + 16 * c + 4 * j + 2 * eh + el


def pv_rows() -> np.ndarray:
  """[512]: row R of the kernel's O^T is latent dim pv_rows()[R]."""
  rr = np.arange(LATENT_DIM)
  blk, r = rr // BLOCK, rr % BLOCK
  half, b = blk // 4, blk % 4
  w, h, g = r // 16, (r // 8) % 2, r % 8
  return HALF * half + 64 * w + 8 * g + 2 * b + h


def _by_thread(owners: dict) -> dict:
  out = {}
  for (warp, lane, reg, e), idx in owners.items():
    out.setdefault((warp, lane), {})[idx] = (reg, e)
  return out


def _a_owners(cols: int = CHUNK) -> dict:
  """{(warp, lane): {(register, element): (row, col)}} of a [64, cols] f16 WGMMA-layout A operand."""
  out = {}
  for (warp, lane, reg, e), idx in register_owners(mgpu.WGMMA_LAYOUT, (PAGE, cols)).items():
    out.setdefault((warp, lane), {})[(reg, e)] = idx
  return out


@functools.lru_cache(maxsize=None)
def qk_register_map() -> dict:
  """{(chunk q, A register index): (tile register index, byte of its 16-byte vector, row slot h)}: A register
  (elements 0, 1) of chunk q's [64, 64] operand is the f16 pair of bytes (byte, byte + 1) of that tile register,
  times the scale of the thread's row 16 w + g + 8 h. Raises unless it is the same map for every thread."""
  raw = _by_thread(register_owners(QK_TILE_LAYOUT.to_mgpu(), (PAGE, FP8_TILE)))
  a = _a_owners()
  perm = qk_dims()[:CHUNK]
  ref = None
  for (warp, lane), regs in a.items():
    m = {}
    for q in range(FP8_TILE // CHUNK):
      for (reg, e), (row, col) in regs.items():
        src_reg, byte = raw[(warp, lane)][(row, CHUNK * q + int(perm[col]))]
        h = (row - 16 * warp - lane // 4) // 8
        if (row - 16 * warp - lane // 4) % 8 or h not in (0, 1):
          raise AssertionError(f"QK A row {row} is not one of thread ({warp}, {lane})'s rows")
        got = (src_reg, byte - e, h)
        if byte % 2 != e or m.setdefault((q, reg), got) != got:
          raise AssertionError(f"QK A register {reg} of chunk {q} is not one byte pair (thread {warp}, {lane})")
    if ref is None:
      ref = m
    elif m != ref:
      raise AssertionError(f"the QK register map of thread ({warp}, {lane}) differs from thread (0, 0)'s")
  return ref


@functools.lru_cache(maxsize=None)
def pv_register_map() -> dict:
  """{(block b', A register index): (tile register of token k, tile register of token k + 1, byte, token k - 2c)}:
  A register (elements 0, 1) of M-block b' of a latent half is the f16 pair (token k, token k + 1) of that byte
  (the dim) of the two tile registers, times the two tokens' scales; k = 2c + the last entry for lane (g, c).
  Raises unless it is the same map for every thread."""
  raw = _by_thread(register_owners(PV_HALF_LAYOUT.to_mgpu(), (PAGE, HALF)))
  a = _a_owners()
  ref = None
  for (warp, lane), regs in a.items():
    m = {}
    for b in range(HALF // BLOCK):
      for (reg, e), (row, tok) in regs.items():
        if e:
          continue
        w, h, g = row // 16, (row // 8) % 2, row % 8
        dim = 64 * w + 8 * g + 2 * b + h
        x_reg, x_byte = raw[(warp, lane)][(tok, dim)]
        y_reg, y_byte = raw[(warp, lane)][(tok + 1, dim)]
        if regs[(reg, 1)] != (row, tok + 1) or x_byte != y_byte:
          raise AssertionError(f"P.V A register {reg} of block {b} is not one dim at a token pair")
        m[(b, reg)] = (x_reg, y_reg, x_byte, tok - 2 * (lane % 4))
    if ref is None:
      ref = m
    elif m != ref:
      raise AssertionError(f"the P.V register map of thread ({warp}, {lane}) differs from thread (0, 0)'s")
  return ref


# ---- GPU: inline PTX per register --------------------------------------------------------------------------
def _words(vec) -> list:
  """An e4m3 vector register -> its 32-bit words."""
  i32 = ir.IntegerType.get_signless(32)
  n = ir.VectorType(vec.type).shape[0] // 4
  words = vector.bitcast(ir.VectorType.get((n,), i32), vec)
  return [vector.extract(words, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([k]))
          for k in range(n)]


def _f16x2_of_f32(s, s2=None):
  """f32 scale(s) -> f16x2 (s, s2 or s) as i32."""
  i32 = ir.IntegerType.get_signless(32)
  return llvm.inline_asm(i32, [s, s if s2 is None else s2], "cvt.rn.f16x2.f32 $0, $2, $1;", "=r,f,f")


def _cvt_scaled(word, half: int, scale2):
  """f16x2 of the e4m3 pair in 16-bit half `half` of word, times scale2 (f16x2; None: unscaled)."""
  i32 = ir.IntegerType.get_signless(32)
  pick = "l" if half == 0 else "h"
  if scale2 is None:
    return llvm.inline_asm(
        i32, [word], f"{{\n.reg .b16 l, h;\nmov.b32 {{l, h}}, $1;\ncvt.rn.f16x2.e4m3x2 $0, {pick};\n}}", "=r,r")
  return llvm.inline_asm(
      i32, [word, scale2],
      "{\n.reg .b16 l, h;\n.reg .b32 t;\nmov.b32 {l, h}, $1;\n"
      f"cvt.rn.f16x2.e4m3x2 t, {pick};\nmul.rn.f16x2 $0, t, $2;\n}}", "=r,r,r")


def _prmt(x, y, selector: int):
  i32 = ir.IntegerType.get_signless(32)
  return llvm.inline_asm(i32, [x, y], f"prmt.b32 $0, $1, $2, {selector:#x};", "=r,r,r")


def _thread():
  """(warp of the warpgroup, lane) as i32 values."""
  i32 = ir.IntegerType.get_signless(32)
  tid = mgpu.utils.thread_idx()
  lane = arith.remui(tid, arith.constant(i32, 32))
  warp = arith.remui(arith.divui(tid, arith.constant(i32, 32)), arith.constant(i32, 4))
  return warp, lane


def _thread_rows():
  """The two rows a thread holds in a [64, k] WGMMA-layout array, 16 w + g and 16 w + g + 8, as i32 values."""
  i32 = ir.IntegerType.get_signless(32)
  warp, lane = _thread()
  row0 = arith.addi(arith.muli(warp, arith.constant(i32, 16)), arith.divui(lane, arith.constant(i32, 4)))
  return row0, arith.addi(row0, arith.constant(i32, 8))


def _scale_at(sc_ref, row, col):
  """sc_ref[row, col] (f32) for i32 values or Python ints."""
  index = ir.IndexType.get()
  at = lambda v: arith.constant(index, v) if isinstance(v, int) else arith.index_cast(index, v)
  return memref.load(sc_ref, [at(row), at(col)])


def _a_array(regs):
  f16x2 = ir.VectorType.get((2,), ir.F16Type.get())
  out = np.empty(regs.shape, dtype=object)
  for idx in np.ndindex(*regs.shape):
    out[idx] = mgpu.utils.bitcast(regs[idx], f16x2)
  return mgpu.FragmentedArray(_registers=out, _layout=mgpu.WGMMA_LAYOUT, _is_signed=None)


_A_TYPE = plgpu.ShapeDtypeStruct((PAGE, CHUNK), jnp.float16, layout=plgpu.Layout.WGMMA)


@functools.lru_cache(maxsize=None)
def qk_operands_gpu(tile: int, scaled: bool = True):
  """(e4m3 [64, 128] column tile `tile` of the page in QK_TILE_LAYOUT, the slot's scales [64, 4] f32) -> the two
  [64, 64] f16 A operands of its chunks (logical columns in qk_dims order), times the rows' scales (scaled=False:
  the e4m3 values alone, for a kernel that applies the scales to S)."""
  shape = mgpu.WGMMA_LAYOUT.registers_shape((PAGE, CHUNK))
  rmap = qk_register_map()

  @plgpu.inline_mgpu(arg_types=(QK_TILE_LAYOUT, plgpu.RefType()), return_type=(_A_TYPE, _A_TYPE))
  def convert(_ctx, raw, sc_ref):
    scales = [_f16x2_of_f32(_scale_at(sc_ref, r, tile)) for r in _thread_rows()] if scaled else [None, None]
    words = {}
    out = []
    for q in range(FP8_TILE // CHUNK):
      regs = np.empty(shape, dtype=object)
      for idx in np.ndindex(*shape):
        src, byte, h = rmap[(q, idx)]
        if src not in words:
          words[src] = _words(raw.registers[src])
        regs[idx] = _cvt_scaled(words[src][byte // 4], (byte % 4) // 2, scales[h])
      out.append(_a_array(regs))
    return tuple(out)

  return convert


@functools.lru_cache(maxsize=None)
def pv_operands_gpu(half: int):
  """(e4m3 [64, 256] latent half `half` of the page in PV_HALF_LAYOUT, the slot's scales [64, 4] f32) -> the four
  [64 dims (pv_rows order), 64 tok] f16 A operands of its M-blocks, times the tokens' scales."""
  shape = mgpu.WGMMA_LAYOUT.registers_shape((PAGE, CHUNK))

  @plgpu.inline_mgpu(arg_types=(PV_HALF_LAYOUT, plgpu.RefType()), return_type=(_A_TYPE,) * 4)
  def convert(_ctx, raw, sc_ref):
    i32 = ir.IntegerType.get_signless(32)
    warp, lane = _thread()
    c2 = arith.muli(arith.remui(lane, arith.constant(i32, 4)), arith.constant(i32, 2))
    tile = arith.addi(arith.constant(i32, 2 * half), arith.divui(warp, arith.constant(i32, 2)))
    scale_of, pair_scales = {}, {}

    def scale(tok_base: int):
      if tok_base not in scale_of:
        scale_of[tok_base] = _scale_at(sc_ref, arith.addi(c2, arith.constant(i32, tok_base)), tile)
      return scale_of[tok_base]

    def scales2(tok_base: int):
      """f16x2 (scale of token k, of token k + 1), once a token pair for the four blocks."""
      if tok_base not in pair_scales:
        pair_scales[tok_base] = _f16x2_of_f32(scale(tok_base), scale(tok_base + 1))
      return pair_scales[tok_base]

    words, pairs, out = {}, {}, []
    for b in range(HALF // BLOCK):
      regs = np.empty(shape, dtype=object)
      for idx in np.ndindex(*shape):
        x_reg, y_reg, word, selector, pick, tok_base = pv_instructions()[(b, idx)]
        for src in (x_reg, y_reg):
          if src not in words:
            words[src] = _words(raw.registers[src])
        key = (x_reg, y_reg, word, selector)
        if key not in pairs:                  # one permute serves rows g and g + 8 (its two halves)
          pairs[key] = _prmt(words[x_reg][word], words[y_reg][word], selector)
        regs[idx] = _cvt_scaled(pairs[key], pick, scales2(tok_base))
      out.append(_a_array(regs))
    return tuple(out)

  return convert


@functools.lru_cache(maxsize=None)
def pv_instructions() -> dict:
  """{(block b', A register index): (register x, register y, word, prmt selector, half, token k - 2c)}: what
  pv_operands_gpu emits for that A register: prmt(word of x, word of y, selector), then the e4m3 pair in that
  16-bit half. For a dim at byte i + h of the word (i even) the selector gives bytes [x_i, y_i, x_i+1, y_i+1], so
  the low half is row g's (tokens k, k + 1) and the high half row g + 8's."""
  out = {}
  for key, (x_reg, y_reg, byte, tok_base) in pv_register_map().items():
    i = byte % 4 - byte % 2
    out[key] = (x_reg, y_reg, byte // 4, i | (4 + i) << 4 | (i + 1) << 8 | (5 + i) << 12, byte % 2, tok_base)
  return out


# ---- scale_on_s: QK's tile scales applied to S (one accumulator a 128-dim scale tile) -------------------------
@functools.lru_cache(maxsize=None)
def acc_row_halves(n: int) -> dict:
  """{register index of a [64, n] f32 WGMMA-layout array: h}: for lane (g, c) of warp w the register holds row
  16 w + g + 8 h (both its elements). Raises unless that holds for every thread."""
  out = {}
  for (warp, lane, reg, _), (row, _) in register_owners(mgpu.WGMMA_LAYOUT, (PAGE, n)).items():
    h, rr = divmod(row - 16 * warp - lane // 4, 8)
    if rr or h not in (0, 1) or out.setdefault(reg, h) != h:
      raise AssertionError(f"[64, {n}] WGMMA register {reg} of thread ({warp}, {lane}) is not row 16w+g+8h")
  return out


@functools.lru_cache(maxsize=None)
def tile_scales_gpu(n: int):
  """(the slot's scales [64, 4] f32 SMEM ref) -> four [64, n] f32 WGMMA arrays, element (r, c) of array t the
  scale of token r's tile t (two loads a tile a thread: its rows 16 w + g and + 8)."""
  shape = mgpu.WGMMA_LAYOUT.registers_shape((PAGE, n))
  half_of = acc_row_halves(n)
  acc_type = plgpu.ShapeDtypeStruct((PAGE, n), jnp.float32, layout=plgpu.Layout.WGMMA)

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),), return_type=(acc_type,) * 4)
  def build(_ctx, sc_ref):
    vec2 = ir.VectorType.get((2,), ir.F32Type.get())
    rows = _thread_rows()
    out = []
    for t in range(LATENT_DIM // FP8_TILE):
      splat = [vector.broadcast(vec2, _scale_at(sc_ref, r, t)) for r in rows]
      regs = np.empty(shape, dtype=object)
      for idx in np.ndindex(*shape):
        regs[idx] = splat[half_of[idx]]
      out.append(mgpu.FragmentedArray(_registers=regs, _layout=mgpu.WGMMA_LAYOUT, _is_signed=None))
    return tuple(out)

  return build


# ---- the permutations as reshapes (no gather), and the operands in jnp for interpret mode ------------------
def q_in_qk_order(q):
  """q [..., 512] -> [..., 512] with column i = latent dim qk_dims()[i]."""
  lead = q.shape[:-1]
  x = q.reshape(*lead, LATENT_DIM // CHUNK, 4, 4, 2, 2)               # chunk, c, j, eh, el
  return jnp.moveaxis(x, -4, -2).reshape(*lead, LATENT_DIM)         # chunk, j, eh, c, el


def row_of_dim(d: jax.Array | None = None) -> jax.Array:
  """int32 [512]: the row of the kernel's O^T that holds latent dim D (pv_rows' inverse; the merge kernel gathers
  its rows in dim order with it): pv_rows' digits (half, b, w, h, g) read back out of D = 256 half + 64 w + 8 g +
  2 b + h. d: the dims to map (any int32 array of values in [0, 512); None: all of them, from an iota). Shifts and
  masks only, so the merge kernel computes its rows itself (split_kv.merge_partials with this function: no table
  operand, no XLA fusion to build one); a traced value, never an array constant (the api's custom_partitioning
  refuses constants)."""
  if d is None:
    d = jax.lax.iota(jnp.int32, LATENT_DIM)
  bits = lambda shift, width: jax.lax.shift_right_logical(d, jnp.int32(shift)) & jnp.int32((1 << width) - 1)
  half, w, g, b, h = bits(8, 1), bits(6, 2), bits(3, 3), bits(1, 2), bits(0, 1)
  return half * HALF + b * BLOCK + w * 16 + h * 8 + g


def qk_operands_jnp(tile_f8, scales):
  """e4m3 [64, 128] tile, scales [64] f32 -> the two [64, 64] f16 A operands (qk_dims order)."""
  x = (tile_f8.astype(jnp.float32) * scales[:, None]).reshape(PAGE, 2, 4, 4, 2, 2)    # tok, q, c, j, eh, el
  x = jnp.moveaxis(x, 2, 4).reshape(PAGE, 2, CHUNK).astype(jnp.float16)             # tok, q, (j, eh, c, el)
  return x[:, 0], x[:, 1]


def pv_operands_jnp(half_f8, scales):
  """e4m3 [64, 256] half (tokens x dims), scales [64, 2] f32 (its two tiles) -> the four [64, 64] f16 A operands
  (V^T rows in pv_rows order)."""
  x = half_f8.astype(jnp.float32).reshape(PAGE, 2, FP8_TILE) * scales[:, :, None]
  x = x.reshape(PAGE, 4, 8, 4, 2)                                          # tok, w, g, b, h
  x = jnp.transpose(x, (3, 1, 4, 2, 0)).reshape(4, BLOCK, PAGE)            # b, (w, h, g), tok
  return tuple(x[b].astype(jnp.float16) for b in range(HALF // BLOCK))
