"""The `mosaic_sm90` backend: int4-weight x bf16-activation GEMMs for Hopper in Pallas Mosaic GPU (`plgpu.kernel`).

Same math and entry shapes as triton.py (`grouped_matmul`, `matmul`, `moe`), built to stream weights at memory
speed (NOTES.md, "Hopper kernel"). Orientation: the weights are the wgmma M side, the tokens the N side:

  acc_w [64 cols, bm tok]  +=  A [64 cols, 32 k] . B [32 k, bm tok]      per nibble plane j of each 256-row chunk
  A = W^T of plane j, decoded in registers;  B = x^T of K rows [32 j, 32 j + 32), a transposed view of SMEM.

CTA (b, p, s) = row block b (block_m rows of one expert), column tile p, K split s; three warpgroups:
  warpgroup 2  producer: per chunk, TMA copies of two [32, 64] int32 word tiles (16 KiB) and the block's x tile
               [bm, 256] bf16 into stage `slot` of a `num_stages` ring (one mbarrier each); per work unit, one copy
               of each consumer's scales and zeros for all the unit's groups into one of two unit slots
               (`unit_scales`; per chunk where units differ in length or the slots do not fit).
  warpgroups 0, 1  consumers: warpgroup w owns one 64-column sub-tile (gated: w = 0 the gate columns, w = 1 the
               same columns of the up half; else columns 128 p + 64 w) and one [64, bm] f32 accumulator.

Decode (GPU): the word tile is loaded from SMEM in WORDS_LAYOUT, the transpose of the wgmma A-operand layout, so a
thread holds exactly the words (r, n), (r + 1, n) (r = 2 i even) of one A-fragment register (n, 2 i..2 i + 1):
in the packed format's order (layout.py, version 3) word r + h holds plane j = 4 h + m's K rows 2 i and 2 i + 1
in nibble m of its two 16-bit halves. One `shr` (none for m = 0) and one `lop3` per register give
(nibble | 0x4300) = 128 + q as bf16x2 (_nibble_asm; format version 2 needed a `prmt` more: the MoE ran 2.9%
slower with it under the H200's power cap, NOTES v14). Scale and zero are folded into A before the product, per
group and per column (each thread's two rows): A = ((128 + q) - (128 + z)) * s in bf16 — the subtraction is
exact, so A is (q - z) * s rounded once to bf16, what the xla reference multiplies. Why fold, not triton.py's
per-group f32 correction: one accumulator for the whole K range (wgmma never waits on a per-group epilogue, no
per-group sum of x is needed), and the fold costs 2 bf16x2 instructions per 2 weights on the FMA pipe, which the
int decode does not use. The price is precision: bf16 products like the xla path instead of exact f32 ones
(docs/architecture.md §4 tolerances hold). The MoE from 16 tokens on uses fold="fma" instead (moe_config): one
fma.rn.bf16x2 per register with a rounded bias, that bias's exact rounding error subtracted by one more k16 wgmma
per chunk against the per-group sums of x.

Interpret mode (CPU) runs neither a register A operand nor inline PTX: the same kernel decodes with jnp, stages A
through an SMEM scratch and stores with jnp (`_INTERPRET_A`). GPU-only code paths are checked by lowering the
kernel for CUDA on the CPU (tests/test_w4a16_mosaic.py), which runs Mosaic GPU's layout, TMA and wgmma checks.

Output: the valid rows of each block in use (a prefix of the block) are written; padding rows and the rows of
unused blocks (expert -1) are left unwritten, as in triton.py (at T = 64 most rows of an 8-row block are padding:
the down projection's float32 rows were ~58 MB written for ~15 MB read). K splits write float32 partials summed by
XLA (the MoE's down projection: in the combine's gather, routing.combine).

Persistent grid (the default): one CTA per SM walks the work units round-robin and the ring runs on across units.
The GPU's power cap, not its memory or issue rate alone, bounds the MoE at T >= 16 on an H200 (NOTES v11): every
copy and instruction saved per weight is time.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
from jax.experimental.mosaic import gpu as mgpu
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, llvm, memref, vector

from pallas_kernels import gpu_interpret
from pallas_kernels.sm90_registers import check_register_split, register_owners
from pallas_kernels.w4a16 import gather_sm90, layout, routing

SUB_N = 64                  # weight columns per consumer warpgroup (wgmma M)
NUM_CONSUMERS = 2
NUM_WARPGROUPS = NUM_CONSUMERS + 1
PLANE = layout.PLANE_K      # 32 K rows per nibble plane
WORD_ROWS = layout.CHUNK_K // layout.NIBBLES   # 32 word rows per chunk
SMEM_LIMIT = 227 * 1024
_MAGIC_BITS = 0x4300

DEFAULT_CONFIG = dict(num_stages=None, target_programs=264, splits=None, consumer_registers=232,
                      producer_registers=40, overlap=None, persistent=True, num_ctas=None,
                      planes_per_wgmma=1, min_block_m=8, convert_in_producer=False, fold="sub_mul", ablate=None,
                      unit_scales=True, stream_k=False, gather_kernel=False, sub_tiles=1, unroll=1)
# overlap: a consumer leaves chunk i's wgmmas in flight while it decodes chunk i + 1 (H200, MoE T=64 g64: 2.26 ->
# 2.15 ms); False waits for them at the end of each chunk. None (the default): on where block_m <= 32 and a consumer
# holds two sub-tiles (sub_tiles 2, the MoE's default from 16 tokens) or two chunks a loop body (unroll 2), off with
# one sub-tile, where it writes the A registers of wgmmas in flight (unroll below) and bought nothing: H100,
# debca4a, device µs, default (the overlap) -> off: dense 7168x18432 / 18432x7168 g64 M = 1 32.7 / 33.7 -> 32.1 /
# 33.0, M = 16 32.5 / 32.7 -> 31.9 / 32.1, M = 32 34.7 / 34.2 -> 34.3 / 33.9; MoE T = 1 g64 84.4 -> 83.7. At block_m 64
# it gave wrong outputs on the H200 (6dee080, dense 7168x18432 M = 64 / 128: every row NaN or off by orders of
# magnitude, with or without unit_scales, masked stores or K splits, at 2 or 3 stages; overlap=False exact; M = 16
# / 32 exact either way), which interpret mode cannot show: a race between the in-flight wgmmas and the next
# chunk, so it is refused there. Measured and removed (NOTES v13; H200, 4c8b9a4 / fc1e452): overlap "ahead" (chunk
# i + 1 decoded into registers the loop carries while chunk i's wgmmas run, then wgmma_wait(0) every chunk, so no
# accumulator with wgmmas in flight crosses the loop's back edge) is exact at block_m 64, which points at that
# crossing as the race, but slower everywhere (MoE T = 64 g64 1,668 -> 2,237 µs, dense 7168x18432 M = 1 30.6 ->
# 40.8, M = 64 44.4 -> 54.4); "pairs" (two chunks per loop body, the second decoded while the first's wgmmas run,
# all waited for before the back edge) is exact at block_m 64 too and gains nothing (M = 64 44.4 -> 45.0, MoE T = 64
# 1,683 -> 1,714, b0de8af); and M > 32 as 32-row blocks with the overlap (max_block_m 32): M = 64 44.0 -> 64.1.
# persistent: a grid of num_ctas CTAs (None: one per SM; 4 in interpret mode) that walk the work units (block,
# column tile, K split) round-robin with one ring across them, instead of one CTA per unit (H200, c51141d: MoE
# T = 1 / 16 / 64 g64 116.6 / 992.7 / 2,172 -> 97.8 / 904.5 / 1,960 µs with target_programs 264, 101 / 907 / 2,000
# with 528; dense 7168x18432 M = 1 / 128 44.6 / 122.8 -> 32.2 / 107.7 µs, but 150.7 at M = 128 with 264).
# target_programs: the K splits aim at this many work units (fewer splits, less partial-sum traffic).
# planes_per_wgmma: consecutive planes of one quantization group issued as one wgmma ([64, 32 P] operand). Mosaic
# builds a shared-memory descriptor per wgmma call (~5 uniform-datapath instructions; SASS at cc56b9b: 80 of the
# ~441 instructions a consumer thread spends per chunk are descriptor arithmetic) and only adds offsets inside a
# call. H200, a5f4223, MoE g128 T = 1 / 16 / 64: P = 1 94.1 / 890.8 / 1,868 µs, P = 4 93.0 / 864.9 / 1,866 (NOTES v8).
# Measured and removed (NOTES v8): plane_split, two consumer warpgroups per 64-column sub-tile, each decoding half of
# every chunk's nibble planes (5 warpgroups): 4-6% slower than one (MoE g64 T = 64 2,033 vs 1,924 µs, b2fe5dd).
# convert_in_producer: the producer warpgroup converts each stage's scales (float16) and zeros (uint8) to the
# bfloat16 s and 128 + z the fold multiplies, once per chunk (4 values per producer thread), one chunk behind its
# copies; the consumers load them ready. Without it every consumer thread converts its two rows' s and z itself
# (~8 instructions per row and group). The same values, so the same output bits. Needs num_stages >= 3.
# fold: how A = (q - z) s is formed from 128 + q. "sub_mul": a bf16 sub and mul per register (2 instructions).
# "fma": one fma.rn.bf16x2, A = (128 + q) s + c with c = bf16(-(128 + z) s); c's rounding error e (exact in bf16:
# the residual of rounding a 16-bit product to 8 bits) is the same for a whole group and column, so it is taken
# out by one more k16 wgmma per chunk: acc -= e . X, X the per-group sums of x split into bf16 hi + lo (XLA computes
# them, TMA streams them with x). Needs convert_in_producer (the producer forms s, c and -e per stage).
FOLDS = ("sub_mul", "fma")
CORR_K = 16                 # K of the correction wgmma: (group, hi / lo) pairs of one chunk, zero-padded
# min_block_m: the smallest row block of a dense matmul (matmul only; the MoE's block_m is w4a16_moe's argument).
# 8 (wgmma N = 8) against 16: dense 7168x18432 / 18432x7168 M = 1 32.1 / 32.2 -> 30.6 / 30.8 µs (H200, 67f54b6).
# unit_scales: each work unit's scales and zeros arrive in one copy per array and consumer (its [chunks x groups,
# 64] tiles) into one of two unit slots, instead of four small copies per 256-row chunk; where the units have
# equal lengths, both slots fit in SMEM beside the ring and (unless the producer converts) a unit is at least as
# long as the ring, else per chunk. H200, 1b8caed, same process, MoE g64 /
# g128: T = 1 81.2 / 77.4 -> 80.3 / 75.5 µs, T = 16 849 / 801 -> 805 / 802, T = 64 1,853 / 1,762 -> 1,743 / 1,681;
# dense unchanged (NOTES v11).
# stream_k: a plain matmul whose row blocks are all in use (dense linears) runs stream-K: each persistent CTA takes an
# equal run of the units' chunks laid end to end (routing.stream_k_plan), so it is never more than one chunk above
# the mean and crosses at most a few unit boundaries (each costs an epilogue and breaks the decode/wgmma overlap);
# the partials of a unit's segments are summed by XLA. K splits instead give 7168x18432 at M = 1 1,008 units of 4
# chunks: the busiest CTA runs 8 units = 32 chunks against a mean of 30.5. On for dense (DENSE_CONFIG): H200,
# 6dee080, device µs, K splits -> stream-K: 7168x18432 M = 1 / 16 31.3 / 34.7 -> 30.7 / 32.4, 18432x7168 31.7 /
# 34.2 -> 31.5 / 32.2.
# gather_kernel: x rows (and the fma fold's X) put in block order by gather_sm90, which writes only the valid rows,
# instead of an XLA gather of all NB * block_m rows (T = 16 / 64, top-8, 8-row blocks: 128 / 512 of 1,024 / 2,304
# rows; the XLA gather took 10.9 / 22.8 µs at 6dee080's 144 / 320 blocks on an H200); in the MoE's down projection
# the fma fold's X is summed over the valid rows only (8.8 / 13.4 µs over all rows). On in moe_config from 16
# tokens: H200, 89e4040, g64 / g128, device µs outside the two grouped kernels, XLA gather -> gather_kernel:
# T = 16 36.9 / 35.0 -> 30.3 / 30.1, T = 64 59.2 / 58.8 -> 45.4 / 40.0; T = 1 9.1 / 9.4 -> 10.8 / 10.6 (off there).
# ablate: timing diagnostics that remove one part of the work and so give WRONG outputs (scripts/bench_w4a16.py
# --sweep only): "load_only" (consumers wait for each stage and release it, no decode or product), "compute_only"
# (the producer arrives on the stage barriers without copying: the consumers run on stale SMEM), "fold" (no
# scale / zero: A = 128 + q), "decode" (A registers are the raw words, no prmt / lop3). Several join with "+":
# "compute_only+fold+decode" leaves the word loads, the descriptors and the wgmmas. "words": the A words are a
# constant, no SMEM loads (GPU only; with "decode" too the A registers are loop-invariant, so what is left is the
# barriers, descriptors and wgmmas; without it LLVM may hoist the now-invariant decode).
# "scales": constant s and bias registers (GPU only; no loads of the stage's scales). "corr": no
# correction wgmma of the fma fold. "nox": no copies of the x tile (and of the correction's X) per chunk, the
# consumers multiply whatever the ring holds; "nosz": no copies of the scales and zeros per chunk (what streaming
# only the weights, or x once per block, would save under the H200's power cap, NOTES v11).
# Measured and removed: "contig", each word tile read as one contiguous 8 KiB run (a tile-major format's DRAM
# pattern): no faster (NOTES v11).
# Measured and removed: x_reuse, a row block's whole x resident in SMEM across R column tiles of "super-units" (copied
# once per R units instead of once per chunk): no gain at R = 2 on an H100 or an H200, +9-11% at R = 4 (NOTES v17,
# v18, v20).
# sub_tiles = R: each consumer warpgroup owns R 64-column sub-tiles of a unit (R accumulators; a unit spans
# 128 R columns, gated: 64 R gate and the same up columns), so every x tile copied into the ring serves R times the
# weight columns. Aimed at 64-row blocks (every dense linear at batch 33-64: x is 32 KiB a chunk against 16 KiB of
# words, copied again for every column tile). A consumer decodes sub-tile r + 1 while sub-tile r's wgmmas run and
# keeps at most one sub-tile's wgmmas in flight, so the A registers held are those of two sub-tiles, as the overlap
# (block_m <= 32) holds two chunks' today; without it nothing stays in flight across the chunk loop's back edge.
# Opt-in; the MoE's default from 16 tokens where it takes 8-row blocks (moe_config; NOTES v18).
# unroll = 2 (opt-in, with the overlap and one sub-tile): a consumer's loop body holds two chunks, each decoded into
# its own A registers. With one chunk a body the overlap decodes chunk i + 1 into the registers chunk i's in-flight
# wgmmas read (PTX: undefined; scripts/sass_wgmma_hazards.py finds ~225 such writes per consumer loop at every block
# size, NOTES v22), and 64-row blocks gave wrong results with it; with two, chunk i's groups are retired before
# chunk i + 2's decode reuses its registers: 0 such writes in the SASS, and ptxas (CUDA 13.0) keeps the overlap at
# 16 and 32 rows; at 64 rows (not enough registers for two sets) and in the MoE at 8-row blocks it serializes
# every wgmma instead (its C7512 / C7513 notes). The overlap at 64-row blocks is allowed with it. H100, debca4a:
# exact (GPU test), but no faster than the overlap off (dense M <= 32 +0.3-1.3 µs, MoE T = 1 +9 µs): opt-in.
ABLATIONS = (None, "load_only", "compute_only", "fold", "decode", "words", "scales", "corr", "nox", "nosz")
OVERLAP_MAX_BLOCK_M = 32
DENSE_CONFIG = dict(target_programs=1056, stream_k=True)


MOE_TARGET_PROGRAMS = 132   # one CTA per SM: K splits only where the blocks' column tiles are fewer than that


def moe_config(group: int, tokens: int, block_m: int = 8) -> dict:
  """The MoE's defaults from 16 tokens on: the producer converts scales and zeros, the fold is one fma, two planes
  per wgmma where a group has two. H200, MoE E=256 D=7168 I=2048 top-8, same process (NOTES v9): g64 T = 16 / 64
  837 / 1,822 -> 820 / 1,772 µs (9845ab5); g128 T = 64 1,748 -> 1,742 (4d55308). Not below 16 tokens (T = 1:
  g64 +1%, g128 +3%) nor for dense linears (the extra group-sum pass: +5% at M = 1). At every size the K splits
  aim at one work unit per SM, not two: at T = 1 gate+up's 256 units then run unsplit, the SiLU product stays in
  the kernel and the partial-sum pass goes (g64 / g128 85.2 / 82.1 -> 82.0 / 79.5 µs, bb1e757, NOTES v10). From 16
  tokens the rows are put in block order by gather_sm90 (gather_kernel; NOTES v13). With 8-row blocks (up to ~64
  tokens) each consumer owns two 64-column sub-tiles of a unit (sub_tiles 2; NOTES v18: sustained on an H200, T = 16
  / 64 g64 916 / 1,899 -> 855 / 1,788 µs, g128 877 / 1,816 -> 833 / 1,715; T = 1 no gain, larger blocks not measured
  for the MoE and slower for 16- and 64-row dense blocks on an H100)."""
  if tokens < 16:
    return dict(target_programs=MOE_TARGET_PROGRAMS)
  return dict(target_programs=MOE_TARGET_PROGRAMS, convert_in_producer=True, fold="fma",
              planes_per_wgmma=2 if group >= 2 * PLANE else 1, gather_kernel=True,
              sub_tiles=2 if block_m <= 8 else 1)

# [32 word rows r, 64 columns n] int32, distributed so that the thread holding A element (n, r) of the wgmma A
# operand W^T [64, 32] (WGMMA layout: warp n // 16, lane 4 (n % 8) + (r % 8) // 2, register (r // 8, (n % 16) // 8),
# vector element r % 2) holds word (r, n). Vector length 1 along n: the SMEM tile is r-major, so r pairs are two
# 32-bit loads (conflict-free on the 128-byte swizzled tile).
_WORDS_TILING = ((8, 64), (8, 16), (8, 8), (2, 1))
WORDS_LAYOUT = plgpu.Layout.TILED(mgpu.fragmented_array.Tiling(_WORDS_TILING), warp_dims=(-7,), lane_dims=(-3, -4),
                                 vector_dim=-1)
_W_SWZ = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))       # int32 rows of 128 bytes
_X_SWZ = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(64))        # bf16 [bm, 32] plane = one tile column
_XS_SWZ = (plgpu.TilingTransform((8, 16)), plgpu.SwizzleTransform(32))       # bf16 [*, 16]: the correction operands
_ROW = plgpu.Layout.WGMMA.reduce(1)         # [64] per A row (weight column): each thread's two rows


@functools.lru_cache(maxsize=None)
def words_register_map() -> dict:
  """{words register index: (A register index, vector element)}: word (r, n), held by a thread in WORDS_LAYOUT,
  feeds element (n, r) of the wgmma A operand [64, 32] (WGMMA layout), held by the same thread. Raises if the two
  layouts do not put every such pair on the same thread at the same register position for every thread."""
  words = register_owners(WORDS_LAYOUT.to_mgpu(), (WORD_ROWS, SUB_N))
  a_owner = {(wp, ln, idx): (reg, e)
             for (wp, ln, reg, e), idx in register_owners(mgpu.WGMMA_LAYOUT, (SUB_N, PLANE)).items()}
  out = {}
  for (wp, ln, reg, _), (r, n) in words.items():
    target = a_owner.get((wp, ln, (n, r)))
    if target is None or out.setdefault(reg, target) != target:
      raise AssertionError(f"WORDS_LAYOUT does not transpose the wgmma A layout at word ({r}, {n})")
  return out


def _nibble_asm(m: int) -> str:
  """$1 = a word whose 16-bit halves hold four nibbles each (K rows 2 i and 2 i + 1 of four planes) -> $0 = bf16x2
  (128 + nibble m of each half): a shift and one lop3. (The shift as a multiply-high, to take it off the integer
  pipe, was 12% slower: NOTES v10.)"""
  if m == 0:
    return "lop3.b32 $0, $1, 0x000F000F, 0x43004300, 0xEA;"
  return "{\n.reg .b32 t;\n" f"shr.u32 t, $1, {4 * m};\n" "lop3.b32 $0, t, 0x000F000F, 0x43004300, 0xEA;\n}"


@functools.lru_cache(maxsize=None)
def _decode_planes_gpu(planes_per_array: int = 1, raw: bool = False):
  """The register decode for arrays of `planes_per_array` (P) consecutive planes: words [32, 64] int32
  (WORDS_LAYOUT) -> 8 / P arrays [64, 32 P] bf16 (WGMMA layout); array i = (W^T of chunk rows 32 P i..) + 128,
  built register by register with inline PTX. A WGMMA-layout array's registers are ordered by 8-column tiles
  along axis 1, so an array of P planes is the planes' register arrays concatenated there
  (tests/test_w4a16_mosaic.py checks that against the layout's tiling). raw: the "decode" ablation (the words
  bitcast, wrong values)."""
  p_arr = planes_per_array
  out_type = plgpu.ShapeDtypeStruct((SUB_N, PLANE * p_arr), jnp.bfloat16, layout=plgpu.Layout.WGMMA)

  @plgpu.inline_mgpu(arg_types=(WORDS_LAYOUT,), return_type=(out_type,) * (layout.NIBBLES // p_arr))
  def decode(_ctx, words):
    i32 = ir.IntegerType.get_signless(32)
    bf16x2 = ir.VectorType.get((2,), ir.BF16Type.get())
    shape = mgpu.WGMMA_LAYOUT.registers_shape((SUB_N, PLANE))
    planes = [np.empty(shape, dtype=object) for _ in range(layout.NIBBLES)]
    pairs = {}
    for widx, (aidx, e) in words_register_map().items():
      reg = words.registers[widx]
      pairs.setdefault(aidx, [None, None])[e] = vector.extract(
          reg, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([0]))
    if len(pairs) != int(np.prod(shape)):
      raise AssertionError(f"words register map covers {len(pairs)} of {shape} A registers")
    for aidx, (lo, hi) in pairs.items():
      for j in range(layout.NIBBLES):
        word = (lo, hi)[j // 4]            # plane j = 4 h + m: word row 2 i + h, nibble m of both halves
        packed = word if raw else llvm.inline_asm(i32, [word], _nibble_asm(j % 4), "=r,r")
        planes[j][aidx] = mgpu.utils.bitcast(packed, bf16x2)
    return tuple(mgpu.FragmentedArray(_registers=np.concatenate(planes[i:i + p_arr], axis=1),
                                      _layout=mgpu.WGMMA_LAYOUT, _is_signed=None)
                 for i in range(0, layout.NIBBLES, p_arr))

  return decode


def _decode_planes_jnp(words, planes_per_array: int = 1):
  """words [32, 64] int32 -> 8 / P arrays [64, 32 P] bf16 (128 + nibble, transposed; P consecutive planes side
  by side); interpret mode. The halves transpose gives format version 2's words, nibble j = K rows 32 j.."""
  words = layout.swap_word_halves(words)
  out = []
  for j in range(layout.NIBBLES):
    v = (lax.shift_right_logical(words, 4 * j) & 0xF) | _MAGIC_BITS
    out.append(lax.bitcast_convert_type(v.astype(jnp.int16), jnp.bfloat16).T)
  return tuple(jnp.concatenate(out[i:i + planes_per_array], axis=1)
               for i in range(0, layout.NIBBLES, planes_per_array))


@functools.lru_cache(maxsize=None)
def _fma_gpu(cols: int):
  """a * b + c on [64, cols] bf16 WGMMA-layout arrays, one fma.rn.bf16x2 per register (Mosaic emits a mul and an
  add)."""
  out_type = plgpu.ShapeDtypeStruct((SUB_N, cols), jnp.bfloat16, layout=plgpu.Layout.WGMMA)

  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,) * 3, return_type=out_type)
  def fma(_ctx, a, b, c):
    bf16x2 = ir.VectorType.get((2,), ir.BF16Type.get())
    i32 = ir.IntegerType.get_signless(32)
    regs = np.empty(a.registers.shape, dtype=object)
    for idx in np.ndindex(*a.registers.shape):
      ops = [mgpu.utils.bitcast(v.registers[idx], i32) for v in (a, b, c)]
      regs[idx] = mgpu.utils.bitcast(llvm.inline_asm(i32, ops, "fma.rn.bf16x2 $0, $1, $2, $3;", "=r,r,r,r"), bf16x2)
    return mgpu.FragmentedArray(_registers=regs, _layout=mgpu.WGMMA_LAYOUT, _is_signed=None)

  return fma


@functools.lru_cache(maxsize=None)
def _corr_operand_gpu(gpc: int):
  """ref [gpc, 64] bf16 (-e per group and weight column, SMEM) -> the correction wgmma's A operand [64, 16] bf16
  (WGMMA layout): element (n, k) = -e[k // 2, n] for k // 2 < gpc, else 0. In the WGMMA layout the thread of lane
  l in warp v holds rows n = 16 v + l // 4 (+ 8) and columns k = 2 (l % 4) + {0, 1} (+ 8), so each register is
  one value twice: 4 scalar loads per thread (tests/test_w4a16_mosaic.py checks the layout formula)."""
  out_type = plgpu.ShapeDtypeStruct((SUB_N, CORR_K), jnp.bfloat16, layout=plgpu.Layout.WGMMA)

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),), return_type=out_type)
  def build(_ctx, ref):
    i32 = ir.IntegerType.get_signless(32)
    idx_t = ir.IndexType.get()
    bf16 = ir.BF16Type.get()
    bf16x2 = ir.VectorType.get((2,), bf16)
    cst = lambda v: mgpu.utils.c(v, i32)
    tid = mgpu.utils.thread_idx()
    lane = arith.remui(tid, cst(32))
    warp = arith.remui(arith.divui(tid, cst(32)), cst(4))
    quad = arith.remui(lane, cst(4))
    row0 = arith.addi(arith.muli(warp, cst(16)), arith.divui(lane, cst(4)))
    zero = vector.broadcast(bf16x2, arith.constant(bf16, ir.FloatAttr.get(bf16, 0.0)))
    shape = mgpu.WGMMA_LAYOUT.registers_shape((SUB_N, CORR_K))
    regs = np.empty(shape, dtype=object)
    for idx in np.ndindex(*shape):
      row_off, col_half = 8 * idx[4], idx[1]
      if 4 * col_half >= gpc:                      # every lane's group is past the chunk's: zero
        regs[idx] = zero
        continue
      g = arith.addi(quad, cst(4 * col_half))
      g_clamped = arith.minui(g, cst(gpc - 1))
      n = arith.addi(row0, cst(row_off))
      v = memref.load(ref, [arith.index_cast(idx_t, g_clamped), arith.index_cast(idx_t, n)])
      pair = vector.broadcast(bf16x2, v)
      if 4 * col_half + 4 > gpc:                   # some lanes' groups are past the chunk's
        pair = arith.select(arith.cmpi(arith.CmpIPredicate.ult, g, cst(gpc)), pair, zero)
      regs[idx] = pair
    return mgpu.FragmentedArray(_registers=regs, _layout=mgpu.WGMMA_LAYOUT, _is_signed=None)

  return build


def _store_transposed_gpu(acc, out_ref, rows_ref=None):
  """out_ref [bm, 64] (GMEM) <- acc [64, bm]^T, one scalar store per element (rows of a block are few; the
  transpose is free in registers); with rows_ref, only the block's first rows_ref[0] rows (its valid ones: padding
  rows are left unwritten)."""
  masked = rows_ref is not None

  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType()) + ((plgpu.RefType(),) if masked else ()))
  def store(_ctx, a, ref, *rows):
    index = ir.IndexType.get()
    valid = arith.index_cast(index, memref.load(rows[0], [arith.constant(index, 0)])) if rows else None

    def put(value, idx):
      if valid is None:
        memref.store(value, ref, [idx[1], idx[0]])
        return
      with mgpu.utils.when(arith.cmpi(arith.CmpIPredicate.slt, idx[1], valid)):
        memref.store(value, ref, [idx[1], idx[0]])
    a.foreach(put)

  store(acc, out_ref, *((rows_ref,) if masked else ()))


def smem_bytes(block_m: int, group: int, stages: int, convert: bool = False, fma: bool = False,
               unit_groups: int = 0, sub_tiles: int = 1) -> int:
  """unit_groups: the groups of a work unit whose scales and zeros are held per unit (two units' worth, see
  unit_scales) instead of per stage. sub_tiles: 64-column sub-tiles per consumer."""
  slots = NUM_CONSUMERS * sub_tiles              # 64-column sub-tiles of a unit
  x_tile = block_m * (layout.CHUNK_K + CORR_K * fma) * 2
  per_stage = (slots * WORD_ROWS * SUB_N * 4
               + slots * (layout.CHUNK_K // group) * SUB_N * (3 * (not unit_groups) + 4 * convert + 2 * fma)
               + x_tile)
  per_unit = 2 * slots * unit_groups * SUB_N * 3
  return stages * per_stage + per_unit + slots * SUB_N * block_m * 4 + 2048


def default_stages(block_m: int, group: int, most: int = 4, convert: bool = False, fma: bool = False,
                   unit_groups: int = 0, sub_tiles: int = 1) -> int:
  """The deepest ring (at most `most` stages, at least 2) whose SMEM fits: 4 at block_m 16 / 32, 3 at 64."""
  stages = most
  while stages > 2 and smem_bytes(block_m, group, stages, convert, fma, unit_groups, sub_tiles) > SMEM_LIMIT:
    stages -= 1
  return stages


@functools.lru_cache(maxsize=None)
def _kernel_call(*, num_blocks: int, block_m: int, tiles: int, splits: int, chunks_per_split: int, n_chunks: int,
                 group: int, n_pad: int, gated: bool, up_offset: int, out_dtype, num_stages: int,
                 consumer_registers: int, producer_registers: int, overlap: bool, num_ctas: int, interpret: bool,
                 planes_per_wgmma: int = 1, ablate: str | None = None, convert_in_producer: bool = False,
                 fold: str = "sub_mul", unit_scales: bool = False, stream_k: int = 0,
                 sub_tiles: int = 1, unroll: int = 1):
  """The jitted kernel for one static configuration (one trace and lowering per shape, as triton._kernel_call).
  stream_k = S > 0 (routing.stream_k_plan's slot count for these units): the persistent CTAs split the chunks of
  all num_blocks x tiles units evenly, each writing a float32 partial per unit it touches into slot `segment` of
  [S, rows, N_pad]. sub_tiles: 64-column sub-tiles per consumer (a column tile is 128 sub_tiles columns, gated 64
  sub_tiles)."""
  gpc = layout.CHUNK_K // group                  # quantization groups per chunk
  ppg = group // PLANE                           # planes per group
  ppw = planes_per_wgmma
  if ppw not in (1, 2, 4, 8) or ppg % ppw:
    raise ValueError(f"w4a16 mosaic_sm90: planes_per_wgmma {ppw} must be 1, 2, 4 or 8 and divide the {ppg} "
                     f"planes of a {group}-row group (one scale per wgmma operand).")
  ablations = set(ablate.split("+")) if ablate else set()
  if not ablations <= set(ABLATIONS) - {None}:
    raise ValueError(f"w4a16 mosaic_sm90: ablate {ablate!r} is not one of {ABLATIONS} or a '+'-joined set of them.")
  stages = num_stages
  on_gpu = not interpret
  split = splits > 1 or stream_k > 0
  rows_total = num_blocks * block_m
  if stream_k and (gated or not num_ctas or unit_scales):
    raise ValueError("w4a16 mosaic_sm90: stream_k runs plain (not gated) matmuls on the persistent grid, without "
                     "unit_scales (its segments differ in length).")
  n_out = n_pad // 2 if gated else n_pad
  gate_in_kernel = gated and not split
  if block_m % 8 or not 8 <= block_m <= 256:
    raise ValueError(f"w4a16 mosaic_sm90: block_m {block_m} must be a multiple of 8 in [8, 256].")
  convert = convert_in_producer
  if fold not in FOLDS:
    raise ValueError(f"w4a16 mosaic_sm90: fold {fold!r} is not one of {FOLDS}.")
  fma = fold == "fma"
  if fma and not convert:
    raise ValueError("w4a16 mosaic_sm90: fold='fma' needs convert_in_producer=True (the producer forms s, c and -e).")
  if convert and stages < 3:
    raise ValueError(f"w4a16 mosaic_sm90: convert_in_producer converts chunk i - 1 after issuing chunk i's copies, "
                     f"so it needs num_stages >= 3, got {stages}.")
  unit_sz = unit_scales and "nosz" not in ablations
  if unit_sz and n_chunks % chunks_per_split:
    raise ValueError(f"w4a16 mosaic_sm90: unit_scales needs units of equal length; {chunks_per_split} chunks per "
                     f"split do not divide {n_chunks}.")
  ug = chunks_per_split * gpc if unit_sz else 0   # groups per unit whose scales and zeros one copy brings
  sub = int(sub_tiles)
  if sub not in (1, 2, 4):
    raise ValueError(f"w4a16 mosaic_sm90: sub_tiles {sub_tiles} must be 1, 2 or 4.")
  if gated and (n_pad // 2) != tiles * sub * SUB_N:
    raise ValueError(f"w4a16 mosaic_sm90: gated {tiles} tiles of {sub} sub-tiles do not cover {n_pad // 2} columns.")
  n_sub = NUM_CONSUMERS * sub                      # 64-column sub-tiles of a unit: v = w * sub + r for consumer w
  need = smem_bytes(block_m, group, stages, convert, fma, ug, sub)
  if need > SMEM_LIMIT:
    raise ValueError(f"w4a16 mosaic_sm90: {stages} stages at block_m {block_m} need {need} bytes of SMEM (limit "
                     f"{SMEM_LIMIT}); lower num_stages.")

  corr = fma and "corr" not in ablations         # the fma fold's correction wgmma
  # the arrivals that complete a stage: one per copy (words per consumer, x, X of the fma's correction; scales
  # and zeros per consumer unless they come per unit), or the converter's one in place of the scales and zeros
  n_loaded = n_sub + 1 + fma + (1 if convert else 0 if unit_sz else 2 * n_sub)
  sz_shape = (2, n_sub, ug, SUB_N) if unit_sz else (stages, n_sub, gpc, SUB_N)
  scratch = dict(
      ring_w=plgpu.SMEM((stages, n_sub, WORD_ROWS, SUB_N), jnp.int32, transforms=_W_SWZ),
      ring_s=plgpu.SMEM(sz_shape, jnp.float16),       # per stage, or per unit (two units) with unit_scales
      ring_z=plgpu.SMEM(sz_shape, jnp.uint8),
      ring_x=plgpu.SMEM((stages, block_m, layout.CHUNK_K), jnp.bfloat16, transforms=_X_SWZ),
      xch=plgpu.SMEM((sub, SUB_N, block_m), jnp.float32),               # the up accumulators, gated epilogue
      # the copies of a stage (weights, x; scales and zeros too unless the producer converts them, then its one
      # arrival after converting)
      loaded=plgpu.Barrier(num_arrivals=n_loaded, num_barriers=stages),
      consumed=plgpu.Barrier(num_arrivals=NUM_CONSUMERS, num_barriers=stages),
      upbar=plgpu.Barrier(num_arrivals=1),
      xfree=plgpu.Barrier(num_arrivals=1))
  if convert:
    scratch["ring_sb"] = plgpu.SMEM((stages, n_sub, gpc, SUB_N), jnp.bfloat16)
    scratch["ring_zb"] = plgpu.SMEM((stages, n_sub, gpc, SUB_N), jnp.bfloat16)
    if not unit_sz:
      scratch["sz_loaded"] = plgpu.Barrier(num_arrivals=2 * n_sub, num_barriers=stages)
  if unit_sz:
    # a unit's scales and zeros (2 copies per sub-tile) in one of two slots; released by the consumers at the
    # unit's end, or (convert) by the producer itself once it converted the unit's last chunk
    scratch["unit_loaded"] = plgpu.Barrier(num_arrivals=2 * n_sub, num_barriers=2)
    if not convert:
      scratch["unit_free"] = plgpu.Barrier(num_arrivals=NUM_CONSUMERS, num_barriers=2)
  if fma:
    scratch["ring_eb"] = plgpu.SMEM((stages, n_sub, gpc, SUB_N), jnp.bfloat16)       # -e per group, column
    scratch["ring_xs"] = plgpu.SMEM((stages, block_m, CORR_K), jnp.bfloat16, transforms=_XS_SWZ)
    if not on_gpu:
      scratch["corr_smem"] = plgpu.SMEM((NUM_CONSUMERS, SUB_N, CORR_K), jnp.bfloat16, transforms=_XS_SWZ)
  if not on_gpu:
    scratch["a_smem"] = plgpu.SMEM((NUM_CONSUMERS, SUB_N, ppw * PLANE), jnp.bfloat16, transforms=_X_SWZ)
  names = list(scratch)

  persistent = num_ctas > 0
  units_per_block = tiles * splits
  if stream_k:
    sk_per_cta = routing.stream_k_plan(num_blocks * tiles, n_chunks, num_ctas)[0]     # chunks per CTA

  def body(block_expert_ref, counts_ref, x_ref, w_ref, s_ref, z_ref, *refs):
    if fma:
      xs_ref, o_ref, *scratch_refs = refs
    else:
      o_ref, *scratch_refs = refs
    r = dict(zip(names, scratch_refs))
    ring_w, ring_s, ring_z, ring_x = r["ring_w"], r["ring_s"], r["ring_z"], r["ring_x"]
    loaded, consumed = r["loaded"], r["consumed"]
    wg = lax.axis_index("wg")

    def unit(u):
      """Work unit u -> (block, column tile, K split, expert, first chunk, chunks); block-major, so the units of
      the blocks in use (a prefix of the blocks, routing.align) are a prefix of the units."""
      b = u // units_per_block
      p = lax.rem(u // splits, tiles)
      sp = lax.rem(u, splits)
      c_lo = sp * chunks_per_split
      n_steps = jnp.maximum(jnp.minimum(c_lo + chunks_per_split, n_chunks) - c_lo, 0)
      return b, p, sp, block_expert_ref[b], c_lo, n_steps

    if stream_k:
      # CTA c streams chunks [c L, c L + L) of the units' chunks laid end to end (unit t = block t // tiles, column
      # tile t % tiles): a segment per unit it touches, the segment's slot = c - the first CTA of that unit
      cta = lax.axis_index("c")
      g_lo = cta * sk_per_cta
      g_hi = jnp.minimum(g_lo + sk_per_cta, num_blocks * tiles * n_chunks)
      t_first = g_lo // n_chunks
      n_segments = jnp.where(g_hi > g_lo, (g_hi - 1) // n_chunks - t_first + 1, 0)

      def segment(i):
        t = t_first + i
        lo = jnp.maximum(g_lo, t * n_chunks)
        hi = jnp.minimum(g_hi, (t + 1) * n_chunks)
        b = t // tiles
        return b, lax.rem(t, tiles), cta - (t * n_chunks) // sk_per_cta, block_expert_ref[b], lo - t * n_chunks, hi - lo

      def for_each_unit(fn):
        """fn(segment info, chunks before it, its ordinal) -> its chunks; returns (chunks, segments)."""
        total = lax.fori_loop(0, n_segments, lambda i, first: first + fn(segment(i), first, i), jnp.int32(0))
        return total, n_segments
      active = True
    elif persistent:
      # CTA c runs units c, c + G, ... of the blocks in use; the ring and its barrier phases run on across units,
      # so the next unit's loads overlap this unit's last chunks and its epilogue
      cta = lax.axis_index("c")
      my_units = jnp.maximum(counts_ref[0] * units_per_block - cta + num_ctas - 1, 0) // num_ctas

      def nth_unit(i):
        return unit(cta + i * num_ctas)

      def for_each_unit(fn):
        """fn(unit info, chunks before it, its ordinal) -> its chunks; returns (chunks, units)."""
        total = lax.fori_loop(0, my_units, lambda i, first: first + fn(nth_unit(i), first, i), jnp.int32(0))
        return total, my_units
      active = True
    else:
      this_unit = unit((lax.axis_index("b") * tiles + lax.axis_index("p")) * splits + lax.axis_index("s"))

      def for_each_unit(fn):
        return fn(this_unit, jnp.int32(0), jnp.int32(0)), jnp.int32(1)
      active = this_unit[3] >= 0                        # expert -1: a block not in use

    def column(p, v: int):
      """First weight column of sub-tile v = w * sub + r (consumer w's r-th) of column tile p."""
      if gated:
        return (v // sub) * up_offset + (p * sub + v % sub) * SUB_N
      # a sub-tile past N_pad (N_pad not a multiple of the tile) re-reads the last one and is not stored
      return jnp.minimum(p * (n_sub * SUB_N) + v * SUB_N, n_pad - SUB_N)

    @pl.when(active)
    def _active():
      @pl.when(wg == NUM_CONSUMERS)
      def _producer():
        if on_gpu:
          plgpu.set_max_registers(producer_registers, action="decrease")

        def convert_stage(g, uslot, idx):
          """Stage of chunk g (chunk idx of the unit in unit slot uslot, with unit_scales): bfloat16 s and 128 + z
          for the consumers (exact: 128..143), then its arrival."""
          slot = lax.rem(g, stages)
          if unit_sz:
            pl.when(idx == 0)(lambda: plgpu.barrier_wait(r["unit_loaded"].at[uslot]))
            s_raw = ring_s[uslot, :, pl.ds(idx * gpc, gpc)]
            z_raw = ring_z[uslot, :, pl.ds(idx * gpc, gpc)]
          else:
            plgpu.barrier_wait(r["sz_loaded"].at[slot])
            s_raw, z_raw = ring_s[slot], ring_z[slot]
          s16 = s_raw.astype(jnp.float32).astype(jnp.bfloat16)
          r["ring_sb"][slot] = s16
          zb = z_raw.astype(jnp.float32) + 128.0                             # exact: 128..143
          if fma:
            prod = zb * s16.astype(jnp.float32)             # (128 + z) s, exact in f32 (16 significant bits)
            c16 = (-prod).astype(jnp.bfloat16)
            r["ring_zb"][slot] = c16                        # the fma's bias
            r["ring_eb"][slot] = (-(c16.astype(jnp.float32) + prod)).astype(jnp.bfloat16)   # -e, exact
          else:
            r["ring_zb"][slot] = zb.astype(jnp.bfloat16)
          plgpu.commit_smem()               # this warpgroup's stores, before its one arrival
          plgpu.barrier_arrive(loaded.at[slot])

        def unit_copies(info, ordinal):
          """A unit's scales and zeros, all its groups in one copy per array and consumer (unit_scales)."""
          _, p, _, expert, c_lo, _ = info
          uslot = lax.rem(ordinal, 2)
          if not convert:
            pl.when(ordinal >= 2)(lambda: plgpu.barrier_wait(r["unit_free"].at[uslot]))
          if "compute_only" in ablations:     # the arrivals the copies would make (a converter waits for none)
            if not convert:
              for _ in range(2 * n_sub):
                plgpu.barrier_arrive(r["unit_loaded"].at[uslot])
            return
          for v in range(n_sub):
            col = pl.ds(column(p, v), SUB_N)
            for src, dst in ((s_ref, ring_s), (z_ref, ring_z)):
              plgpu.copy_gmem_to_smem(src.at[expert, pl.ds(c_lo * gpc, ug), col], dst.at[uslot, v],
                                      r["unit_loaded"].at[uslot])

        def copy_x(b, c, dst, bar):
          """Block b's x tile of chunk c (and the fma fold's X) into slot dst of ring_x (ring_xs)."""
          plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(b * block_m, block_m), pl.ds(c * layout.CHUNK_K, layout.CHUNK_K)],
                                  ring_x.at[dst], bar)
          if fma:
            plgpu.copy_gmem_to_smem(xs_ref.at[pl.ds(b * block_m, block_m), pl.ds(c * CORR_K, CORR_K)],
                                    r["ring_xs"].at[dst], bar)

        def produce(info, first, ordinal):
          b, p, _, expert, c_lo, n_steps = info
          if unit_sz:
            pl.when(n_steps > 0)(lambda: unit_copies(info, ordinal))

          def step(i, _):
            g = first + i                             # chunks this CTA has streamed: the ring position
            slot = lax.rem(g, stages)
            c = c_lo + i

            @pl.when(g >= stages)
            def _():
              plgpu.barrier_wait(consumed.at[slot])

            if "compute_only" in ablations:     # the arrivals the copies would make, no bytes
              for _ in range(n_loaded):
                plgpu.barrier_arrive(loaded.at[slot])
              return ()
            sz_bar = r["sz_loaded"].at[slot] if convert and not unit_sz else loaded.at[slot]
            if "nosz" in ablations:     # the arrivals the scale and zero copies would make, no bytes
              for _ in range(2 * n_sub):
                plgpu.barrier_arrive(sz_bar)
            if "nox" in ablations:
              for _ in range(1 + fma):
                plgpu.barrier_arrive(loaded.at[slot])
            for v in range(n_sub):
              col = pl.ds(column(p, v), SUB_N)
              plgpu.copy_gmem_to_smem(w_ref.at[expert, pl.ds(c * WORD_ROWS, WORD_ROWS), col], ring_w.at[slot, v],
                                      loaded.at[slot])
              if not unit_sz and "nosz" not in ablations:
                plgpu.copy_gmem_to_smem(s_ref.at[expert, pl.ds(c * gpc, gpc), col], ring_s.at[slot, v], sz_bar)
                plgpu.copy_gmem_to_smem(z_ref.at[expert, pl.ds(c * gpc, gpc), col], ring_z.at[slot, v], sz_bar)
            if "nox" not in ablations:
              copy_x(b, c, slot, loaded.at[slot])
            if convert:
              # chunk g - 1's scales and zeros have had one chunk's copies' time to land (with unit_scales: the
              # previous chunk of this unit, or the last of the previous unit, whose units all have cps chunks)
              prev_uslot = lax.rem(ordinal + jnp.where(i > 0, 2, 1), 2)
              prev_idx = jnp.where(i > 0, i - 1, chunks_per_split - 1)
              pl.when(g > 0)(lambda: convert_stage(g - 1, prev_uslot, prev_idx))
            return ()

          lax.fori_loop(0, n_steps, step, ())
          return n_steps

        total, n_units = for_each_unit(produce)
        if convert and "compute_only" not in ablations:
          pl.when(total > 0)(lambda: convert_stage(total - 1, lax.rem(n_units + 1, 2), chunks_per_split - 1))
        for i in range(stages):       # observe the release of the last stages: no barrier phase left pending
          @pl.when(total + i >= stages)
          def _():
            plgpu.barrier_wait(consumed.at[lax.rem(total + i, stages)])
        if unit_sz and not convert:   # and of the last two units' scales and zeros
          for j in range(2):
            @pl.when((n_units + j >= 2) & (total > 0))
            def _():
              plgpu.barrier_wait(r["unit_free"].at[lax.rem(n_units + j, 2)])

      def consumer(w: int):
        if on_gpu:
          plgpu.set_max_registers(consumer_registers, action="increase")

        def chunk_products(acc_ref, slot, uslot, idx, v):
          """acc_ref += sub-tile v's products of the chunk in ring stage `slot` (its words, x and scales)."""
          if "load_only" in ablations:
            return
          biases, scales = [], []       # per group, broadcast to one operand: 128 + z (or fma's c), and s
          for gi in range(gpc):
            if "scales" in ablations and on_gpu:     # constant s and bias: no loads
              biases.append(plgpu.layout_cast(jnp.full((SUB_N, ppw * PLANE), -136.0, jnp.bfloat16),
                                              plgpu.Layout.WGMMA))
              scales.append(plgpu.layout_cast(jnp.full((SUB_N, ppw * PLANE), 0.5, jnp.bfloat16), plgpu.Layout.WGMMA))
              continue
            if convert:
              s16, z16 = [plgpu.load(ref.at[slot, v, gi], layout=_ROW, optimized=False) if on_gpu
                          else ref[slot, v, gi] for ref in (r["ring_sb"], r["ring_zb"])]
            else:
              at = (uslot, v, idx * gpc + gi) if unit_sz else (slot, v, gi)
              if on_gpu:
                s = plgpu.load(ring_s.at[at], layout=_ROW, optimized=False)
                z = plgpu.load(ring_z.at[at], layout=_ROW, optimized=False)
              else:
                s, z = ring_s[at], ring_z[at]
              s16 = s.astype(jnp.float32).astype(jnp.bfloat16)
              z16 = (z.astype(jnp.float32) + 128.0).astype(jnp.bfloat16)      # exact: 128..143
            biases.append(lax.broadcast_in_dim(z16, (SUB_N, ppw * PLANE), [0]))
            scales.append(lax.broadcast_in_dim(s16, (SUB_N, ppw * PLANE), [0]))
          if on_gpu:
            if "words" in ablations:
              words = plgpu.layout_cast(jnp.full((WORD_ROWS, SUB_N), 0x01234567, jnp.int32), WORDS_LAYOUT)
            else:
              words = plgpu.load(ring_w.at[slot, v], layout=WORDS_LAYOUT, optimized=False)
            arrays = _decode_planes_gpu(ppw, raw="decode" in ablations)(words)
          else:
            arrays = _decode_planes_jnp(ring_w[slot, v], ppw)

          def folded(i, a):
            """Array i (planes ppw i .. ppw i + ppw - 1, all of quantization group ppw i // ppg) -> (q - z) s."""
            bias, scale = biases[i * ppw // ppg], scales[i * ppw // ppg]
            if not fma:
              return (a - bias) * scale                  # bf16, exact sub, one rounding
            if on_gpu:                                   # (128 + q) s + c, one rounding
              return _fma_gpu(ppw * PLANE)(a, scale, bias)
            return (a.astype(jnp.float32) * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(jnp.bfloat16)

          weights = arrays if "fold" in ablations else [folded(i, a) for i, a in enumerate(arrays)]
          for i, a in enumerate(weights):
            xt = ring_x.at[slot, :, pl.ds(i * ppw * PLANE, ppw * PLANE)].transpose((1, 0))    # [32 ppw, bm]
            if on_gpu:
              plgpu.wgmma(acc_ref, a, xt)
            else:
              r["a_smem"][w] = a
              plgpu.wgmma(acc_ref, r["a_smem"].at[w], xt)
          if corr:
            # acc += (-e) . X: columns (group g, hi / lo) of the chunk, X's rows likewise
            xst = r["ring_xs"].at[slot].transpose((1, 0))                                      # [16, bm]
            if on_gpu:
              plgpu.wgmma(acc_ref, _corr_operand_gpu(gpc)(r["ring_eb"].at[slot, v]), xst)
            else:
              e = r["ring_eb"][slot, v]                                                          # [gpc, 64]
              a_c = jnp.pad(jnp.repeat(e.T, 2, axis=1), ((0, 0), (0, CORR_K - 2 * gpc)))
              r["corr_smem"][w] = a_c
              plgpu.wgmma(acc_ref, r["corr_smem"].at[w], xst)

        def consume(info, first, ordinal):
          b, p, sp, _, _, n_steps = info
          uslot = lax.rem(ordinal, 2)
          own_unit_sz = unit_sz and not convert         # these warpgroups read the unit's scales and zeros
          if own_unit_sz:
            pl.when(n_steps > 0)(lambda: plgpu.barrier_wait(r["unit_loaded"].at[uslot]))

          def release(g):
            """The chunk at ring position g is done: its stage back to the producer."""
            plgpu.barrier_arrive(consumed.at[lax.rem(g, stages)])

          def run(*acc_refs):
            def step(i, _):
              g = first + i
              slot = lax.rem(g, stages)
              plgpu.barrier_wait(loaded.at[slot])
              for t, acc_ref in enumerate(acc_refs):      # sub-tile t + 1 decodes while t's products run
                chunk_products(acc_ref, slot, uslot, i, w * sub + t)
                if overlap or t < sub - 1:
                  # sub-tile t's products stay in flight while the next one (of this chunk, or with the overlap
                  # of chunk i + 1) decodes: wait only for the previous one's (one wgmma group per plane), so at
                  # most two sub-tiles' A registers are live; after the first sub-tile that was chunk i - 1's
                  # last, so its slot goes back
                  plgpu.wgmma_wait(layout.NIBBLES // ppw + corr)
                  if overlap and t == 0:
                    pl.when(i > 0)(lambda: release(g - 1))
              if not overlap:
                plgpu.wgmma_wait(0)
                release(g)
              return ()

            if unroll == 2:
              # two chunks a body, each with its own A registers; an odd last chunk after the loop
              lax.fori_loop(0, n_steps // 2, lambda j, c: step(2 * j + 1, step(2 * j, c)), ())

              @pl.when(n_steps % 2 == 1)
              def _():
                step(n_steps - 1, ())
            else:
              lax.fori_loop(0, n_steps, step, ())
            if overlap:
              plgpu.wgmma_wait(0)
              pl.when(n_steps > 0)(lambda: release(first + n_steps - 1))
            if own_unit_sz:     # every chunk's scales are in registers or consumed: the unit slot is free
              pl.when(n_steps > 0)(lambda: plgpu.barrier_arrive(r["unit_free"].at[uslot]))
            return tuple(acc_ref[...] for acc_ref in acc_refs)

          # one [64 cols, bm] f32 accumulator per sub-tile
          accs = pl.run_scoped(run, *[plgpu.ACC((SUB_N, block_m), jnp.float32) for _ in range(sub)])
          rows = pl.ds(b * block_m, block_m)
          if gate_in_kernel and w == 1:
            # hand the up accumulators to warpgroup 0; xch is free again once it read the previous unit's
            @pl.when(first > 0)
            def _():
              plgpu.barrier_wait(r["xfree"])

            for t, acc in enumerate(accs):
              r["xch"][t] = acc
            plgpu.commit_smem()
            plgpu.barrier_arrive(r["upbar"])
            return n_steps
          if gate_in_kernel:
            plgpu.barrier_wait(r["upbar"])
            ups = [plgpu.load(r["xch"].at[t], layout=plgpu.Layout.WGMMA, optimized=False) if on_gpu
                   else r["xch"][t] for t in range(sub)]
            plgpu.barrier_arrive(r["xfree"])
            accs = [acc * jax.nn.sigmoid(acc) * up for acc, up in zip(accs, ups)]
          for t, acc in enumerate(accs):
            v = w * sub + t
            col = column(p, v)
            if gate_in_kernel:
              dst = o_ref.at[rows, pl.ds((p * sub + t) * SUB_N, SUB_N)]
            elif split:
              dst = o_ref.at[sp, rows, pl.ds(col, SUB_N)]
            else:
              dst = o_ref.at[rows, pl.ds(col, SUB_N)]
            y = acc.astype(o_ref.dtype)
            in_range = gated or (p * (n_sub * SUB_N) + v * SUB_N < n_pad)

            @pl.when(in_range)
            def _store():
              if on_gpu:
                _store_transposed_gpu(y, dst, counts_ref.at[pl.ds(1 + b, 1)])
              else:
                valid = lax.broadcasted_iota(jnp.int32, (block_m, SUB_N), 0) < counts_ref[1 + b]
                dst[...] = jnp.where(valid, y.T, dst[...])
          return n_steps

        total, _ = for_each_unit(consume)
        if gate_in_kernel and w == 1:
          @pl.when(total > 0)
          def _():
            plgpu.barrier_wait(r["xfree"])      # warpgroup 0 read the last unit's xch: no phase left pending

      for w in range(NUM_CONSUMERS):
        pl.when(wg == w)(functools.partial(consumer, w))

  if split:
    out_type = jax.ShapeDtypeStruct((stream_k or splits, rows_total, n_pad), jnp.float32)
  else:
    out_type = jax.ShapeDtypeStruct((rows_total, n_out), out_dtype)
  kernel = plgpu.kernel(
      body, out_type=out_type, scratch_types=list(scratch.values()),
      grid=(num_ctas,) if persistent else (num_blocks, tiles, splits),
      grid_names=("c",) if persistent else ("b", "p", "s"), num_threads=NUM_WARPGROUPS, thread_name="wg",
      # every SMEM hand-off is ordered by an mbarrier or commit_smem; no cross-warp reduction
      compiler_params=plgpu.CompilerParams(unsafe_no_auto_barriers=True, reduction_scratch_bytes=0),
      interpret=plgpu.InterpretGPUParams() if interpret else False,
      )
  return jax.jit(kernel)


def sum_stream_k(parts: jax.Array, valid: np.ndarray, block_m: int, sub_tiles: int = 1) -> jax.Array:
  """Stream-K partials [S, NB*block_m, N_pad] -> [NB*block_m, N_pad] float32: the sum over the slots each unit
  (row block, column tile of 128 sub_tiles columns) wrote, valid [S, NB*tiles] (routing.stream_k_plan). Slots a unit did not write
  hold whatever the buffer held and are never added."""
  slots, rows, n_pad = parts.shape
  nb, cols = rows // block_m, NUM_CONSUMERS * SUB_N * sub_tiles
  tiles = -(-n_pad // cols)
  parts = jnp.pad(parts, ((0, 0), (0, 0), (0, tiles * cols - n_pad))).reshape(slots, nb, block_m, tiles, cols)
  keep = jnp.asarray(valid.reshape(slots, nb, 1, tiles, 1))
  return jnp.where(keep, parts, 0.0).sum(axis=0).reshape(rows, tiles * cols)[:, :n_pad]


def group_sums(x: jax.Array, group: int) -> jax.Array:
  """x [R, K_pad] -> [R, K_pad / 256 * 16] bf16: per 256-row chunk, for each quantization group g of it the sum
  of x over the group split into hi = bf16(X) and lo = bf16(X - hi) at columns 2 g and 2 g + 1, zero past the
  chunk's groups (the correction operand of fold='fma')."""
  r, k_pad = x.shape
  gpc = layout.CHUNK_K // group
  sums = x.astype(jnp.float32).reshape(r, k_pad // group, group).sum(axis=-1)
  hi = sums.astype(jnp.bfloat16)
  lo = (sums - hi.astype(jnp.float32)).astype(jnp.bfloat16)
  pairs = jnp.stack([hi, lo], axis=-1).reshape(r, k_pad // layout.CHUNK_K, 2 * gpc)
  return jnp.pad(pairs, ((0, 0), (0, 0), (0, CORR_K - 2 * gpc))).reshape(r, -1)


def block_rows(x: jax.Array, row_token: jax.Array, k_pad: int) -> jax.Array:
  """x rows in block order [NB*bm, K_pad] bf16 (zero on padding rows and past K): TMA streams a block's tile."""
  valid = row_token >= 0
  xb = jnp.where(valid[:, None], jnp.take(x, jnp.maximum(row_token, 0), axis=0), 0).astype(jnp.bfloat16)
  return jnp.pad(xb, ((0, 0), (0, k_pad - x.shape[1])))


def grouped_matmul(x: jax.Array, w: layout.W4A16Weight, block_expert: jax.Array, row_token: jax.Array,
                   row_weight: jax.Array, *, block_m: int, gated: bool, weighted: bool, out_dtype,
                   busy_blocks: int, interpret: bool = False, config: dict | None = None,
                   x_in_block_order: bool = False, keep_splits: bool = False,
                   pair_row: jax.Array | None = None) -> jax.Array:
  """triton.grouped_matmul's contract on the Hopper kernel: rows [NB*block_m, N_out] (N_out = N_pad/2 gated);
  padding rows and the rows of unused blocks are garbage (never written); a block's valid rows (row_token >= 0)
  must be a prefix of it, as routing.align and dense_blocks make them. x rows are gathered (and K-padded) by XLA
  into block order first (or, with gather_kernel, only the valid rows by gather_sm90), unless x_in_block_order:
  x is already [NB*block_m, >= K] in block order (the first grouped matmul's output, garbage in its padding rows:
  a token is one wgmma column, so a padding row's values reach only that row's output), the kernel reads it where
  it is, and row_token only marks the valid rows (any value >= 0). `weighted` multiplies the rows by row_weight
  after the kernel. keep_splits (not gated, not weighted): the K splits are
  chosen to balance the persistent grid (routing.balanced_k_splits) and, where there are several, returned as
  float32 partials [S, NB*block_m, N_pad] for the caller to sum (routing.combine does it in its gather).
  pair_row (Routing.pair_row [T, K]), with gather_kernel: the rows are copied one per (token, expert) pair, and
  with x in block order the fma fold's X is summed over the valid rows only."""
  cfg = dict(DEFAULT_CONFIG, **(config or {}))
  unknown = sorted(set(cfg) - set(DEFAULT_CONFIG))
  if unknown:
    raise ValueError(f"w4a16 mosaic_sm90: unknown config keys {unknown}; known: {sorted(DEFAULT_CONFIG)}.")
  check_register_split([cfg["producer_registers"]] + [cfg["consumer_registers"]] * NUM_CONSUMERS,
                       "w4a16 mosaic_sm90 (producer, consumers)")
  if interpret:
    gpu_interpret.check_cpu_threads(NUM_WARPGROUPS)      # else interpret mode can deadlock (gpu_interpret.py)
  if w.group_size not in layout.KERNEL_GROUP_SIZES:
    raise ValueError(f"w4a16 mosaic_sm90 is built for group sizes {layout.KERNEL_GROUP_SIZES}, got {w.group_size}.")
  n_chunks = w.k_pad // layout.CHUNK_K
  nb = block_expert.shape[0]
  sub = int(cfg["sub_tiles"])
  fma = cfg["fold"] == "fma"
  convert = bool(cfg["convert_in_producer"])
  min_stages = 3 if convert else 2                # the producer's conversion runs one chunk behind its copies
  # fewer sub-tiles where the gate half's do not pair up into whole tiles, or where the ring would be too shallow
  while sub > 1 and ((gated and (w.n_pad // 2) % (SUB_N * sub))
                     or smem_bytes(block_m, w.group_size, min_stages, convert, fma, 0, sub) > SMEM_LIMIT):
    sub //= 2
  if gated:
    tiles = (w.n_pad // 2) // (SUB_N * sub)
  else:
    tiles = -(-w.n_pad // (NUM_CONSUMERS * SUB_N * sub))
  if keep_splits and (gated or weighted):
    raise ValueError("grouped_matmul: keep_splits returns unweighted partial sums of a plain (not gated) matmul.")
  num_ctas = 0
  overlap = cfg["overlap"]
  unroll = cfg["unroll"]
  if unroll not in (1, 2) or isinstance(unroll, bool):
    raise ValueError(f"w4a16 mosaic_sm90: unroll must be 1 or 2 chunks a consumer loop body, got {unroll!r}.")
  if overlap is None:
    # on only where it is free of the register hazard (two sub-tiles or two chunks a loop body; see unroll above)
    overlap = block_m <= OVERLAP_MAX_BLOCK_M and (sub > 1 or unroll == 2)
  elif overlap and block_m > OVERLAP_MAX_BLOCK_M and unroll == 1:
    raise ValueError(f"w4a16 mosaic_sm90: overlap=True at block_m {block_m} gives wrong results on the GPU (measured "
                     f"on an H200); it is allowed up to block_m {OVERLAP_MAX_BLOCK_M}, or at any block_m with "
                     f"unroll=2. Leave overlap unset (None) or pass overlap=False.")
  if unroll == 2 and not (overlap and sub == 1):
    raise ValueError(f"w4a16 mosaic_sm90: unroll=2 gives the overlap of one sub-tile a second set of A registers; it "
                     f"needs the overlap on and sub_tiles 1 (got overlap={bool(overlap)}, sub_tiles {sub}).")
  if cfg["persistent"]:
    num_ctas = int(cfg["num_ctas"] or (4 if interpret else getattr(jax.devices()[0], "core_count", 132)))
  # explicit K splits take precedence over stream-K
  stream_k = (bool(cfg["stream_k"]) and not cfg.get("splits") and num_ctas > 0 and not gated and busy_blocks == nb
              and not keep_splits)
  if stream_k:
    splits = 1
    _, slots, valid = routing.stream_k_plan(nb * tiles, n_chunks, num_ctas)
  elif cfg.get("splits"):
    splits = cfg["splits"]
  elif keep_splits and num_ctas:
    # a split's partials cost a write of its rows and a read in the caller's gather: in chunk-equivalents of one
    # CTA's time, at most rows x N_pad x 4 bytes (only valid rows are written) against a chunk on every CTA
    chunk_bytes = layout.CHUNK_K * SUB_N * NUM_CONSUMERS * sub // 2
    partial = block_expert.shape[0] * block_m * w.n_pad * 4 / (chunk_bytes * num_ctas)
    splits = routing.balanced_k_splits(n_chunks, busy_blocks * tiles, num_ctas, partial)
  else:
    splits = routing.k_splits(n_chunks, busy_blocks * tiles, cfg["target_programs"])
  cps = -(-n_chunks // splits)
  splits = -(-n_chunks // cps)
  stages = cfg["num_stages"] or default_stages(block_m, w.group_size, convert=convert, fma=fma, sub_tiles=sub)
  gpc = layout.CHUNK_K // w.group_size
  # per-unit scales where the units are equal, their two slots fit, and the slots cannot hold the ring back: the
  # consumers free a unit's slot at its end, so with units shorter than the ring the producer could run only two
  # units ahead (the producer's own conversion frees it sooner)
  unit_scales = (bool(cfg["unit_scales"]) and not stream_k and n_chunks % cps == 0 and (convert or cps >= stages)
                 and smem_bytes(block_m, w.group_size, stages, convert, fma, cps * gpc, sub) <= SMEM_LIMIT)
  extra = ()
  if x_in_block_order:
    xb = x.astype(jnp.bfloat16)
    if not xb.shape[1] == w.k == w.k_pad:            # zero K padding (never trust columns past K)
      xb = jnp.pad(xb[:, :w.k], ((0, 0), (0, w.k_pad - w.k)))
    if fma and cfg["gather_kernel"] and pair_row is not None:
      # the valid rows' sums only ([P, ...], not NB * block_m rows), copied to their rows
      dst = pair_row.reshape(-1)
      sums = group_sums(jnp.take(xb, jnp.maximum(dst, 0), axis=0), w.group_size)
      extra = tuple(gather_sm90.copy_rows([sums], jnp.arange(dst.shape[0], dtype=jnp.int32), dst, nb * block_m,
                                          interpret=interpret))
    elif fma:
      extra = (group_sums(xb, w.group_size),)
  elif cfg["gather_kernel"]:
    # only the valid rows written (gather_sm90), the correction's X rows in the same call: one copy per (token,
    # expert) pair where the pairs are known, else one per row
    xp = jnp.pad(x.astype(jnp.bfloat16), ((0, 0), (0, w.k_pad - x.shape[1])))
    arrays = [xp] + ([group_sums(xp, w.group_size)] if fma else [])
    if pair_row is not None:
      t, k = pair_row.shape
      xb, *extra = gather_sm90.copy_rows(arrays, jnp.arange(t * k, dtype=jnp.int32) // k, pair_row.reshape(-1),
                                         nb * block_m, interpret=interpret)
    else:
      xb, *extra = gather_sm90.gather_rows(arrays, row_token, interpret=interpret)
    extra = tuple(extra)
  else:
    xb = block_rows(x, row_token, w.k_pad)
    if fma:   # the correction's X: from the token rows (gathered after: T rows, not NB * block_m)
      xs = group_sums(jnp.pad(x, ((0, 0), (0, w.k_pad - x.shape[1]))), w.group_size)
      extra = (jnp.where((row_token >= 0)[:, None], jnp.take(xs, jnp.maximum(row_token, 0), axis=0), 0),)
  call = _kernel_call(num_blocks=nb, block_m=block_m, tiles=tiles, splits=splits, chunks_per_split=cps,
                      n_chunks=n_chunks, group=w.group_size, n_pad=w.n_pad, gated=gated, up_offset=w.n_pad // 2,
                      out_dtype=jnp.dtype(out_dtype), num_stages=stages,
                      consumer_registers=cfg["consumer_registers"], producer_registers=cfg["producer_registers"],
                      overlap=bool(overlap), num_ctas=num_ctas, interpret=bool(interpret),
                      planes_per_wgmma=int(cfg["planes_per_wgmma"]), ablate=cfg["ablate"],
                      convert_in_producer=convert, fold=cfg["fold"], unit_scales=unit_scales,
                      stream_k=slots if stream_k else 0, sub_tiles=sub, unroll=unroll)
  # [blocks in use (a prefix, routing.align), then each block's valid rows (a prefix of it): the rows stored]
  # (NumPy for a dense call's blocks, routing.dense_blocks: a constant of the program, not a ~1 µs kernel)
  xp = np if isinstance(block_expert, np.ndarray) and isinstance(row_token, np.ndarray) else jnp
  counts = xp.concatenate([xp.sum(block_expert >= 0, dtype=np.int32).reshape(1),
                           xp.sum((row_token >= 0).reshape(nb, block_m), axis=1, dtype=np.int32)])
  out = call(block_expert, counts, xb, w.packed, w.scales, w.zeros, *extra)
  if stream_k:
    out = sum_stream_k(out, valid, block_m, sub)
  elif splits > 1 and keep_splits:
    return out
  elif splits > 1:
    out = out.sum(axis=0)
    if gated:
      n_out = w.n_pad // 2
      out = jax.nn.silu(out[:, :n_out]) * out[:, n_out:]
  if weighted:
    out = out.astype(jnp.float32) * row_weight[:, None]
  return out.astype(out_dtype)


def matmul(x: jax.Array, w: layout.W4A16Weight, *, interpret: bool = False, config: dict | None = None,
           out_dtype=None):
  """x [M, K] bf16 @ W [K, N] -> [M, N] in out_dtype (default bf16). M rows padded to 8 / 16 / 32 / 64 per block;
  where M fills its blocks (M = 8, 16, 32 or a multiple of 64: every decode batch of 64) the kernel reads x where
  it is, without a copy into block order (V3 slice, H200: a 1.4-2.4 µs select fusion before each such linear)."""
  cfg = {**DENSE_CONFIG, **(config or {})}
  return routing.dense_matmul(grouped_matmul, x, w, config=cfg, interpret=interpret, out_dtype=out_dtype,
                              min_block_m=int(cfg.get("min_block_m", DEFAULT_CONFIG["min_block_m"])),
                              reads_x_in_place=True)


def moe(x, routing_: routing.Routing, w13: layout.W4A16Weight, w2: layout.W4A16Weight, *, busy_blocks: int,
        interpret: bool = False, config: dict | None = None):
  """[T, D] float32: Σ_k w · down(silu(gate x) · up x). The router weights are applied in the combine (over T*K
  rows of D), not on the [NB*block_m, D] kernel output."""
  bm = routing_.block_m
  h = grouped_matmul(x, w13, routing_.block_expert, routing_.row_token, routing_.row_weight, block_m=bm,
                     gated=True, weighted=False, out_dtype=x.dtype, busy_blocks=busy_blocks, interpret=interpret,
                     config={**moe_config(w13.group_size, x.shape[0], bm), **(config or {})},
                     pair_row=routing_.pair_row)
  # h is in block order already: the down projection reads its rows in place (no gather; 13 µs at T = 64 on an
  # H200 for the copy this replaces)
  # its K splits balance the grid (T = 1: 8 blocks x 56 tiles of 8 chunks run as 2 x 4 chunks) and are summed
  # in the combine's gather
  # with x in block order row_token only marks the valid rows: the gate|up call's own, so XLA computes the
  # kernels' counts array once (one ~1 µs kernel fewer per MoE call)
  y = grouped_matmul(h, w2, routing_.block_expert, routing_.row_token, routing_.row_weight,
                     block_m=bm, gated=False, weighted=False, out_dtype=jnp.float32, busy_blocks=busy_blocks,
                     interpret=interpret, config={**moe_config(w2.group_size, x.shape[0], bm), **(config or {})},
                     x_in_block_order=True, keep_splits=True, pair_row=routing_.pair_row)
  return routing.combine(y[..., :w2.n], routing_, apply_weights=True)
