"""The `triton` backend: portable paged MLA decode (Pallas Triton lowering, sm80+; CPU with interpret=True).

Shape of the work (the op of docs/architecture.md §3): query rows are (token, head) pairs, row r = i * H + h,
packed into blocks of block_r rows (padded inside this module). Grid = (row blocks, splits, batch); program
(r, s, b) walks chunk s of sequence b's pages (block_n tokens at a time, page looked up in the block table
in-kernel) with an online softmax and writes a partial (o, lse) in f32; an XLA step combines the splits (with one
split the kernel writes the final output). The grid's first axis varies fastest at launch, so the row blocks
sharing a stretch of cache run side by side and share it through L2.

bf16 cache: per chunk, s = q_lat . k_lat^T + q_rope . k_rope^T (bf16 MMAs, f32 accumulation), o += p . k_lat.

fp8 cache, decoded without fp8 hardware (sm80 has no e4m3 conversion in Triton):
- The latent is read as int32 words, 4 e4m3 bytes each, so each 128-wide scale tile t splits into 4 byte
  planes k = columns 128t + 4i + k (i < 32). q_lat and the output carry the same column order outside the
  kernel (_to_byte_planes), so the kernel's MMAs run per plane.
- Decode: the int8 pattern s|eeee|mmm, sign-extended to int16, shifted left 7 and masked with 0xBF80, is the
  float16 s|0eeee|mmm0000000 = e4m3 value * 2^-8, exactly, subnormals included (both formats put the subnormal
  step at 2^-(bias-1) times the mantissa). The MMAs run in f16 on these values, which needs no float
  conversion instruction at all (a bf16 MMA would need f16 -> f32 -> bf16 per element).
- The production path (default_config) decodes with inline PTX: one prmt (two bytes sign-extended into two
  16-bit lanes at once), shl, and per pair of elements, all sm80 integer instructions. Up to 32 query rows it
  reads int32 words in byte-plane order ("ptx_planes"); above, int8 in column order, 4 bytes per PTX call
  ("ptx_bytes"). The PTX takes its shift count from a run-time operand so that Triton decodes each tile once,
  where it is loaded, rather than once per MMA operand layout (see _word_plane_ptx).
- The `fp8_decode` config key also selects variants kept for scripts/bench_mla.py's sweep and the tests: "int"
  (the jnp form, ~14 instructions per pair as LLVM emits it), "ptx_tile" (planes interleaved back into column
  order, one MMA chain per tile) and "native" (the sm89+ hardware conversion, a yardstick for the integer
  decode). Interpret mode runs the jnp decode for every variant (inline PTX has no CPU form);
  tests/test_mla_triton.py checks the PTX on a bit-level model.
- q_lat enters as f16 times a per-row power of two (exact, _f16_rows); per-token tile scales (x 2^8) multiply
  the [rows x tokens] scores, and for P . V they multiply p divided by the chunk's largest scale of the tile
  (exact powers of two, so p stays <= 1 in f16), that largest scale multiplying the MMA result.
Slots past a sequence's length are loaded masked (never read, 0 instead) and their scores selected to -inf, so
NaN in unused slots or pages cannot reach a sum; pages past the length are never visited.
"""
from __future__ import annotations

import functools
import math
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

with warnings.catch_warnings():
  # The Triton lowering is deprecated in favour of Mosaic GPU but is the portable (sm80) path; jax is pinned.
  warnings.simplefilter("ignore", DeprecationWarning)
  from jax.experimental.pallas import triton as pltriton

from pallas_kernels.mla_decode.cache import FP8_TILE, LATENT_DIM, ROPE_DIM, MLAKVCache

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
_N_TILES = LATENT_DIM // FP8_TILE          # 4 tiles of 128 latent columns
_F16_FROM_E4M3 = 256.0                     # decoded f16 = e4m3 value / 2^8


def _e4m3_bits_to_f16(bits: jax.Array) -> jax.Array:
  """int8 bit patterns of float8_e4m3fn -> float16 holding value / 256 (exact; integer ops only)."""
  w = bits.astype(jnp.int16)                         # sign-extend: s fills bits 15..7
  w = (w << 7) & jnp.int16(-16512)                  # 0xBF80: s -> bit 15, clear bit 14, eeeemmm -> bits 13..7
  return lax.bitcast_convert_type(w, jnp.float16)


_WORDS = FP8_TILE // 4                     # int32 words per fp8 tile


# Inline-PTX versions of _e4m3_bits_to_f16 (same bits; GPU only, interpret mode runs the jnp decode). One
# `prmt` builds two 16-bit lanes, each holding an e4m3 byte in its low byte and that byte's sign replicated
# (selector nibble 8 + byte index) in its high byte: the int8 -> int16 sign extension of two elements at once.
# Then `<< 7` and `& 0xBF80` per lane as in _e4m3_bits_to_f16 (bits shifted across the lane boundary land in
# bits 0..6, which the mask clears). 3 integer instructions per pair of elements, all on sm80 (no fp8 hardware).
_PTX_SHIFT = 7
_PTX_MASK = 0xBF80BF80


def _prmt_selector(lane0_byte: int, lane1_byte: int) -> int:
  """prmt.b32 selector: lane 0 (bits 0..15) = sign-extended byte lane0_byte of {b, a} (0..3 = a, 4..7 = b)."""
  return lane0_byte | (8 | lane0_byte) << 4 | lane1_byte << 8 | (8 | lane1_byte) << 12


def _pair_asm(dst: str, a: str, b: str, selector: int, shift: str = str(_PTX_SHIFT)) -> str:
  return (f"prmt.b32 t, {a}, {b}, {selector:#06x};\nshl.b32 t, t, {shift};\n"
          f"and.b32 {dst}, t, {_PTX_MASK:#010x};\n")


def _word_plane_asm(k: int) -> str:
  """Two int32 words ($1, $2; Triton packs pack=2 consecutive elements) -> f16 of byte k of each ($0); the
  shift count comes from a register ($3 = $4 = 7, see _word_plane_ptx)."""
  return "{\n.reg .b32 t;\n" + _pair_asm("$0", "$1", "$2", _prmt_selector(k, 4 + k), "$3") + "}"


# four bytes in one register ($2; Triton packs pack=4 int8 elements, element i = byte i) -> 4 f16 ($0, $1); the
# shift count from a register ($3, the first of 4 int32 shift operands, see _word_plane_ptx)
_BYTES_ASM = ("{\n.reg .b32 t;\n" + _pair_asm("$0", "$2", "0", _prmt_selector(0, 1), "$3")
              + _pair_asm("$1", "$2", "0", _prmt_selector(2, 3), "$3") + "}")


def _word_plane_ptx(words: jax.Array, k: int, shift: jax.Array) -> jax.Array:
  """_e4m3_bits_to_f16(_byte(words, k)) for int32 words, by inline PTX.

  shift: int32, words' shape, = _PTX_SHIFT everywhere but computed at run time. It is there for Triton's
  sake: an elementwise op whose other operands are constants gets the MMA operand layout conversion hoisted
  above it, so the tile would be decoded once per MMA operand layout (QK's K^T and PV's V: twice, from int32
  words ldmatrix'ed in each layout). A run-time operand keeps the decode where the words are loaded; Triton
  then converts the decoded f16 tile to both operand layouts through shared memory (SASS: 64 prmt per
  thread per 32-token chunk instead of 128, 183 registers instead of 234).
  """
  [out] = pltriton.elementwise_inline_asm(
      _word_plane_asm(k), args=[words, shift], constraints="=r,r,r,r,r", pack=2,
      result_shape_dtypes=[jax.ShapeDtypeStruct(words.shape, jnp.float16)])
  return out


def _e4m3_bits_to_f16_ptx(bits: jax.Array, shift: jax.Array) -> jax.Array:
  """_e4m3_bits_to_f16 for int8 bit patterns, by inline PTX, 4 bytes per call; shift as in _word_plane_ptx."""
  [out] = pltriton.elementwise_inline_asm(
      _BYTES_ASM, args=[bits, shift], constraints="=r,=r,r,r,r,r,r", pack=4,
      result_shape_dtypes=[jax.ShapeDtypeStruct(bits.shape, jnp.float16)])
  return out


def _byte(words: jax.Array, k: int) -> jax.Array:
  """Byte k (little-endian) of each int32 word, as an int8 bit pattern."""
  return lax.shift_right_arithmetic(words << (24 - 8 * k), 24).astype(jnp.int8)


def _to_byte_planes(x: jax.Array) -> jax.Array:
  """[..., 512] latent column order -> byte-plane order: position 128t + 32k + i holds column 128t + 4i + k."""
  lead = x.shape[:-1]
  x = x.reshape(*lead, _N_TILES, _WORDS, 4)
  return jnp.swapaxes(x, -1, -2).reshape(*lead, LATENT_DIM)


def _from_byte_planes(x: jax.Array) -> jax.Array:
  """Inverse of _to_byte_planes."""
  lead = x.shape[:-1]
  x = x.reshape(*lead, _N_TILES, 4, _WORDS)
  return jnp.swapaxes(x, -1, -2).reshape(*lead, LATENT_DIM)


def _dot_nt(a, b):
  """a [m, k] . b[n, k]^T in f32."""
  return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _dot_nn(a, b):
  return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _decode_kernel(block_table_ref, seq_lens_ref, q_lat_ref, q_rope_ref, latent_ref, rope_ref, *rest,
                   fp8: bool, fp8_decode: str, interpret: bool, num_heads: int, q_len: int, causal: bool,
                   scale_log2: float, block_r: int, block_n: int, page_size: int, num_pages: int, max_pages: int,
                   num_splits: int):
  if fp8:
    scale_ref, q_scale_ref, o_ref, lse_ref = rest
  else:
    scale_ref = q_scale_ref = None
    o_ref, lse_ref = rest
  row_block, split, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  chunks_per_page = page_size // block_n

  length = seq_lens_ref[b]
  # Never past the table, whatever the length says (the api turns such rows into NaN).
  n_chunks = jnp.minimum(pl.cdiv(jnp.maximum(length, 0), block_n), max_pages * chunks_per_page)
  per_split = pl.cdiv(n_chunks, num_splits)
  start = split * per_split
  end = jnp.minimum(start + per_split, n_chunks)

  rows = row_block * block_r + lax.broadcasted_iota(jnp.int32, (block_r,), 0)
  if causal and q_len > 1:
    limit = length - q_len + 1 + rows // num_heads      # row (i, h) sees keys < L - Sq + i + 1
  else:
    limit = jnp.full((block_r,), length, jnp.int32)

  # Column groups: (latent tile t, q columns, width). The integer fp8 path reads the latent as int32 words, so
  # tile t splits into 4 byte planes k (columns 128t + 4i + k, i < 32), which q_lat and the output carry
  # permuted the same way (see _to_byte_planes).
  word_fp8 = fp8 and fp8_decode in _WORD_DECODES
  native_fp8 = fp8 and fp8_decode == "native"
  if fp8 and fp8_decode in _PLANE_DECODES:
    groups = [(t, t * FP8_TILE + k * _WORDS, _WORDS) for t in range(_N_TILES) for k in range(4)]
  else:
    groups = [(t, t * FP8_TILE, FP8_TILE) for t in range(_N_TILES)]
  q_groups = [q_lat_ref[:, pl.ds(col, width)] for _, col, width in groups]   # [block_r, width] bf16 | f16 (fp8)
  q_rope = q_rope_ref[...]                                                    # bf16 [block_r, 64]
  q_scale = q_scale_ref[...] if fp8 else None                                 # f32 [block_r]: q_lat = f16 * this

  def body(c, carry):
    m_prev, l_prev, accs = carry
    page = block_table_ref[b, c // chunks_per_page]
    page = jnp.clip(page, 0, num_pages - 1)            # a bad entry must not fault; the api NaNs the row
    off = (c % chunks_per_page) * block_n
    tok = c * block_n + lax.broadcasted_iota(jnp.int32, (block_n,), 0)
    in_seq = tok < length
    slots = pl.ds(off, block_n)

    k_rope = pltriton.load(rope_ref.at[page, slots, :], mask=in_seq[:, None], other=0)
    s = _dot_nt(q_rope, k_rope)                                                   # [block_r, block_n]
    ks, tile_scales = [], []
    for t in range(_N_TILES):
      if fp8:
        sc = pltriton.load(scale_ref.at[page, slots, jnp.int32(t)], mask=in_seq, other=0.0)
        tile_scales.append(sc if native_fp8 else sc * _F16_FROM_E4M3)
      if word_fp8:
        words = pltriton.load(latent_ref.at[page, slots, pl.ds(t * _WORDS, _WORDS)], mask=in_seq[:, None],
                              other=0)                                            # int32 [block_n, 32]
        if fp8_decode == "int" or interpret:
          planes = [_e4m3_bits_to_f16(_byte(words, k)) for k in range(4)]
        else:
          # = _PTX_SHIFT (tok >= 0), but not a constant to Triton (see _word_plane_ptx)
          shift = jnp.broadcast_to((_PTX_SHIFT + jnp.minimum(tok, 0))[:, None], words.shape)
          planes = [_word_plane_ptx(words, k, shift) for k in range(4)]
        if fp8_decode in _PLANE_DECODES:
          ks += planes                                                            # 4 x f16 [block_n, 32]
        else:
          # interleave the planes back into column order 4i + k: one [block_n, 128] operand per tile, so QK
          # and PV are one MMA chain per tile (4 in all, not 16), and the tile is decoded once before Triton
          # converts it to the two MMA operand layouts
          pairs = [jnp.stack([planes[0], planes[2]], axis=-1), jnp.stack([planes[1], planes[3]], axis=-1)]
          ks.append(jnp.stack(pairs, axis=-1).reshape(block_n, FP8_TILE))
      else:
        tile = latent_ref.at[page, slots, pl.ds(t * FP8_TILE, FP8_TILE)]
        if fp8_decode == "ptx_bytes":
          bits = pltriton.load(tile, mask=in_seq[:, None], other=0)              # int8 [block_n, 128]
          if interpret:
            ks.append(_e4m3_bits_to_f16(bits))
          else:
            shift = jnp.broadcast_to((_PTX_SHIFT + jnp.minimum(tok, 0))[:, None], bits.shape)
            ks.append(_e4m3_bits_to_f16_ptx(bits, shift))
        elif native_fp8:
          # the hardware e4m3 conversion (sm89+), kept as a diagnostic of what the integer decode costs; the
          # lowering cannot fill masked fp8 lanes with a constant, so select after converting
          ks.append(jnp.where(in_seq[:, None], pltriton.load(tile, mask=in_seq[:, None]).astype(jnp.float16), 0))
        else:
          ks.append(pltriton.load(tile, mask=in_seq[:, None], other=0))
    s_lat = None
    for t in range(_N_TILES):
      s_t = None
      for g, (tg, _, _) in enumerate(groups):
        if tg == t:
          d = _dot_nt(q_groups[g], ks[g])
          s_t = d if s_t is None else s_t + d
      s_t = s_t * tile_scales[t][None, :] if fp8 else s_t
      s_lat = s_t if s_lat is None else s_lat + s_t
    s = s + (s_lat * q_scale[:, None] if fp8 else s_lat)

    visible = tok[None, :] < limit[:, None]
    s = jnp.where(visible, s * scale_log2, -jnp.inf)
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1))
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)   # a row that has seen nothing yet stays at 0 weight
    alpha = jnp.exp2(m_prev - m_use)
    p = jnp.exp2(s - m_use[:, None])
    l_new = l_prev * alpha + jnp.sum(p, axis=1)
    if fp8:
      # p * scale[token, t] in f16 would overflow for large scales: divide by the chunk's largest scale of the
      # tile (powers of two: exact, and the result is <= p) and multiply that back in after the MMA.
      tile_max = [jnp.max(sc) for sc in tile_scales]
      tile_max = [jnp.where(mx > 0, mx, 1.0) for mx in tile_max]
      p_tiles = [(p * (sc * (1.0 / mx))[None, :]).astype(jnp.float16) for sc, mx in zip(tile_scales, tile_max)]
      new_accs = tuple(accs[g] * alpha[:, None] + tile_max[t] * _dot_nn(p_tiles[t], ks[g])
                       for g, (t, _, _) in enumerate(groups))
    else:
      p_bf16 = p.astype(jnp.bfloat16)
      new_accs = tuple(accs[g] * alpha[:, None] + _dot_nn(p_bf16, ks[g]) for g in range(len(groups)))
    return m_new, l_new, new_accs

  m0 = jnp.full((block_r,), -jnp.inf, jnp.float32)
  l0 = jnp.zeros((block_r,), jnp.float32)
  acc0 = tuple(jnp.zeros((block_r, width), jnp.float32) for _, _, width in groups)
  m, l, accs = lax.fori_loop(start, end, body, (m0, l0, acc0))

  seen = l > 0
  inv_l = jnp.where(seen, 1.0 / jnp.where(seen, l, 1.0), 0.0)
  for (_, col, width), acc in zip(groups, accs):
    o_ref[:, pl.ds(col, width)] = (acc * inv_l[:, None]).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(seen, (m + jnp.log2(jnp.where(seen, l, 1.0))) * _LN2, -jnp.inf)


# fp8_decode: "int" jnp integer decode of int32 words, byte-plane column order (16 column groups);
# "ptx_planes" the same by inline PTX; "ptx_tile" PTX word decode, planes interleaved back to column order
# (4 groups); "ptx_bytes" int8 loads in column order, PTX 4 bytes per call; "native" sm89+ e4m3 conversion.
# Production (default_config) uses ptx_planes (<= 32 rows) and ptx_bytes (more); the others are benchmark
# and test variants.
_FP8_DECODES = ("int", "ptx_planes", "ptx_tile", "ptx_bytes", "native")
_WORD_DECODES = ("int", "ptx_planes", "ptx_tile")      # latent read as int32 words
_PLANE_DECODES = ("int", "ptx_planes")                 # q_lat and the output in byte-plane column order


def _next_pow2(x: int) -> int:
  return 1 << max(0, (x - 1).bit_length())


def _sm_count(interpret: bool) -> int:
  if interpret:
    return 8     # interpret mode: a small pretend GPU, so tests exercise several splits
  dev = jax.devices()[0]
  return int(getattr(dev, "core_count", 0) or 108)


def default_config(batch: int, rows: int, max_pages: int, page_size: int, *, interpret: bool,
                   cache_dtype: str = "fp8_e4m3") -> dict:
  """Kernel configuration from the problem size: block_r, block_n, num_splits, num_warps, num_stages, fp8_decode.

  The defaults are the fastest configurations of scripts/bench_mla.py's sweep on the H200 (b128 L4096; numbers
  and commit in NOTES.md). fp8: the inline-PTX byte-plane decode ("ptx_planes": 3 instructions per pair of
  elements, each tile decoded once) with 16-row blocks and 32-token chunks (64-token chunks spill and ran 1.3x
  slower). Up to 32 rows (h16 Sq2) the same kernel runs two row blocks that share the cache through L2.
  More rows: 64-row blocks share each decoded tile, which needs 8 warps (at 4 a [64, 512] f32 accumulator is 256
  registers a thread) and the column-order byte decode ("ptx_bytes", 4 accumulators). bf16: 32-row blocks for
  many heads (64 spills), 32-token chunks.
  """
  fp8 = cache_dtype == "fp8_e4m3"
  many_fp8 = fp8 and rows > 32
  if rows <= 16 or (fp8 and not many_fp8):
    block_r = 16
  elif many_fp8:
    block_r = 64
  else:
    block_r = 32
  block_n = min(32, page_size)
  row_blocks = pl.cdiv(rows, block_r)
  max_chunks = max_pages * (page_size // block_n)
  # About one wave of two programs per SM; at least 8 chunks per split (partials cost 2 * 4 * 512 B per row).
  num_splits = max(1, min((2 * _sm_count(interpret)) // (batch * row_blocks), pl.cdiv(max_chunks, 8)))
  return dict(block_r=block_r, block_n=block_n, num_splits=num_splits, num_warps=8 if many_fp8 else 4,
              num_stages=2, fp8_decode="ptx_bytes" if many_fp8 else "ptx_planes")


def check_supported(q: jax.Array, cache: MLAKVCache) -> None:
  """ValueError if this kernel cannot serve the (already validated) inputs."""
  if cache.dtype not in ("bfloat16", "fp8_e4m3"):
    raise ValueError(f"the triton backend supports bfloat16 and fp8_e4m3 caches, not {cache.dtype}; "
                     "use backend='xla' for a float32 cache")
  if q.dtype != jnp.bfloat16:
    raise ValueError(f"the triton backend needs bfloat16 q, got {q.dtype}")
  ps = cache.page_size
  if ps < 16 or ps & (ps - 1):
    raise ValueError(f"the triton backend needs a power-of-two page_size >= 16, got {ps}")
  nbytes = cache.latent.size * cache.latent.dtype.itemsize
  if cache.dtype == "fp8_e4m3" and 2**31 <= nbytes <= 2**32:
    # Pallas Triton switches to 64-bit offsets only above 4 GiB; 1-byte elements between 2 and 4 GiB would
    # overflow its signed 32-bit offsets.
    raise ValueError(f"the triton backend cannot address an fp8 latent pool of {nbytes} bytes (2-4 GiB: 32-bit "
                     "offsets overflow); allocate fewer than 65536 or more than 131072 pages of 64 tokens")


def mla_decode(q: jax.Array, cache: MLAKVCache, block_table: jax.Array, seq_lens: jax.Array, *,
               softmax_scale: float, causal: bool, interpret: bool = False, **config) -> tuple[jax.Array, jax.Array]:
  """Backend entry (see api.py for the convention). config overrides default_config's keys (tests, tuning)."""
  check_supported(q, cache)
  b, sq, h, _ = q.shape
  rows = sq * h
  max_pages = block_table.shape[1]
  cfg = default_config(b, rows, max_pages, cache.page_size, interpret=interpret, cache_dtype=cache.dtype)
  unknown = set(config) - set(cfg)
  if unknown:
    raise ValueError(f"unknown triton config keys {sorted(unknown)}; known: {sorted(cfg)}")
  cfg.update(config)
  block_r, block_n, num_splits = cfg["block_r"], cfg["block_n"], cfg["num_splits"]
  if block_r < 16 or block_r & (block_r - 1):
    raise ValueError(f"block_r must be a power of two >= 16, got {block_r}")
  if block_n < 16 or block_n & (block_n - 1) or cache.page_size % block_n:
    raise ValueError(f"block_n must be a power of two >= 16 dividing page_size {cache.page_size}, got {block_n}")
  if num_splits < 1:
    raise ValueError(f"num_splits must be >= 1, got {num_splits}")
  if cfg["fp8_decode"] not in _FP8_DECODES:
    raise ValueError(f"fp8_decode must be one of {_FP8_DECODES} ('int': integer bit decode in jnp ops; 'ptx_*': "
                     f"the same bits by inline PTX prmt/shl/and -- all of these run on any sm80+ GPU; 'native': "
                     f"the sm89+ e4m3 conversion), got {cfg['fp8_decode']!r}")
  fp8_decode = cfg["fp8_decode"]

  padded = pl.cdiv(rows, block_r) * block_r
  q_rows = q.reshape(b, rows, LATENT_DIM + ROPE_DIM)
  if padded != rows:
    q_rows = jnp.pad(q_rows, ((0, 0), (0, padded - rows), (0, 0)))
  q_lat, q_rope = q_rows[..., :LATENT_DIM], q_rows[..., LATENT_DIM:]

  fp8 = cache.dtype == "fp8_e4m3"
  word_fp8 = fp8 and fp8_decode in _WORD_DECODES
  latent = cache.latent
  if word_fp8:
    # 4 fp8 bytes per int32 word (a free bitcast); q and the output use the matching byte-plane column order
    num_pages, ps, _ = latent.shape
    latent = lax.bitcast_convert_type(latent.reshape(num_pages, ps, LATENT_DIM // 4, 4), jnp.int32)
  if fp8 and fp8_decode in _PLANE_DECODES:
    q_lat = _to_byte_planes(q_lat)
  elif fp8 and fp8_decode == "ptx_bytes":
    latent = lax.bitcast_convert_type(latent, jnp.int8)       # bit patterns, decoded in-kernel
  if fp8:
    q_lat, q_scale = _f16_rows(q_lat)
  operands = [block_table, seq_lens, q_lat, q_rope, latent, cache.rope] + ([cache.scale, q_scale] if fp8 else [])

  def whole(x):
    return pl.BlockSpec(x.shape, lambda r, s, bb, _n=x.ndim: (0,) * _n)

  in_specs = [
      whole(block_table), whole(seq_lens),
      pl.BlockSpec((None, block_r, LATENT_DIM), lambda r, s, bb: (bb, r, 0)),
      pl.BlockSpec((None, block_r, ROPE_DIM), lambda r, s, bb: (bb, r, 0)),
      whole(latent), whole(cache.rope)] + (
          [whole(cache.scale), pl.BlockSpec((None, block_r), lambda r, s, bb: (bb, r))] if fp8 else [])
  out_specs = [pl.BlockSpec((None, None, block_r, LATENT_DIM), lambda r, s, bb: (bb, s, r, 0)),
               pl.BlockSpec((None, None, block_r), lambda r, s, bb: (bb, s, r))]
  # One split: the kernel writes the final output in q's dtype (no f32 partials, no combine pass).
  out_shape = [jax.ShapeDtypeStruct((b, num_splits, padded, LATENT_DIM),
                                    q.dtype if num_splits == 1 else jnp.float32),
               jax.ShapeDtypeStruct((b, num_splits, padded), jnp.float32)]
  kernel = functools.partial(
      _decode_kernel, fp8=fp8, fp8_decode=fp8_decode, interpret=bool(interpret), num_heads=h, q_len=sq,
      causal=bool(causal), scale_log2=float(softmax_scale) * _LOG2E, block_r=block_r, block_n=block_n,
      page_size=cache.page_size, num_pages=cache.num_pages, max_pages=max_pages, num_splits=num_splits)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    o_part, lse_part = pl.pallas_call(
        kernel, grid=(padded // block_r, num_splits, b), in_specs=in_specs, out_specs=out_specs,
        out_shape=out_shape, interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]),
        name=f"mla_decode_{cache.dtype}",
    )(*operands)

  if num_splits == 1:
    out, lse = o_part[:, 0], jnp.where(lse_part[:, 0] == -jnp.inf, jnp.inf, lse_part[:, 0])
  else:
    out, lse = combine_splits(o_part, lse_part)             # [B, padded, 512], [B, padded]
  if fp8 and fp8_decode in _PLANE_DECODES:
    out = _from_byte_planes(out)
  out = out[:, :rows].reshape(b, sq, h, LATENT_DIM).astype(q.dtype)
  lse = lse[:, :rows].reshape(b, sq, h).transpose(0, 2, 1)
  return out, lse


def _f16_rows(q_lat: jax.Array) -> tuple[jax.Array, jax.Array]:
  """bf16 rows [..., D] -> (f16 rows, f32 row scale) with q = f16 * scale exactly.

  The scale is a power of two putting each row's largest |value| in [2^13, 2^14): bf16's 8 significant bits fit
  f16's 11, products with decoded fp8 (<= 1.75) stay far from f16 and f32 limits, and only elements below
  2^-30 of the row's largest lose bits (their share of a dot product is below f32 rounding).
  """
  x = q_lat.astype(jnp.float32)
  _, exp = jnp.frexp(jnp.max(jnp.abs(x), axis=-1))              # max < 2^exp (exp = 0 for an all-zero row)
  shift = 14 - exp
  return jnp.ldexp(x, shift[..., None]).astype(jnp.float16), jnp.ldexp(jnp.ones_like(x[..., 0]), -shift)


def combine_splits(o_part: jax.Array, lse_part: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Merges split-KV partials: o [B, S, R, D] (each normalized), lse [B, S, R] (-inf = empty) ->
  o [B, R, D], lse [B, R] (+inf where every split was empty)."""
  lse_max = jnp.max(lse_part, axis=1)                                   # [B, R]
  any_seen = lse_max > -jnp.inf
  ref = jnp.where(any_seen, lse_max, 0.0)
  w = jnp.exp(lse_part - ref[:, None])                                  # empty split -> 0
  total = jnp.sum(w, axis=1)
  o = jnp.sum(w[..., None] * o_part, axis=1)
  o = jnp.where(any_seen[..., None], o / jnp.where(any_seen, total, 1.0)[..., None], 0.0)
  lse = jnp.where(any_seen, ref + jnp.log(jnp.where(any_seen, total, 1.0)), jnp.inf)
  return o, lse
