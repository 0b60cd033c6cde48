"""triton backend: the fp8 decode variants (fp8_decode config key) and the inline PTX they run on a GPU.

Interpret mode runs the jnp integer decode for every variant (inline PTX has no CPU implementation), so the
PTX strings themselves are checked here by a bit-level model of the three instructions they use (prmt with
sign-replicating selectors, shl, and) over every e4m3 byte, against the jnp decode and against ml_dtypes.
"""
import re

import ml_dtypes
import numpy as np
import pytest

from pallas_kernels.mla_decode import triton as triton_backend
from test_mla_decode import SCALE, assert_matches, make_problem, reference


def _prmt(a: int, b: int, selector: int) -> int:
  """PTX prmt.b32 (default mode): byte j of the result = byte (nibble j & 7) of {b, a}, or that byte's sign
  replicated when nibble j has bit 3 set."""
  src = [(a >> 8 * i) & 0xFF for i in range(4)] + [(b >> 8 * i) & 0xFF for i in range(4)]
  out = 0
  for j in range(4):
    nib = (selector >> 4 * j) & 0xF
    byte = src[nib & 7]
    if nib & 8:
      byte = 0xFF if byte & 0x80 else 0
    out |= byte << 8 * j
  return out


def _run_asm(asm: str, regs: dict[str, int]) -> dict[str, int]:
  """Executes the prmt/shl/and PTX the kernel emits on 32-bit registers ($n and locals)."""
  regs = dict(regs)
  val = lambda x: regs[x] if x in regs else int(x, 0)  # noqa: E731
  for line in asm.splitlines():
    line = line.strip().rstrip(";")
    if not line or line in "{}" or line.startswith(".reg"):
      continue
    op, args = line.split(None, 1)
    d, *src = [x.strip() for x in args.split(",")]
    if op == "prmt.b32":
      regs[d] = _prmt(val(src[0]), val(src[1]), val(src[2]))
    elif op == "shl.b32":
      regs[d] = (val(src[0]) << val(src[1])) & 0xFFFFFFFF
    elif op == "and.b32":
      regs[d] = val(src[0]) & val(src[1])
    else:
      raise AssertionError(f"instruction {op} has no model here; add one before using it in the kernel")
  return regs


def _f16_lanes(reg: int) -> np.ndarray:
  return np.array([reg & 0xFFFF, reg >> 16], np.uint16).view(np.float16)


ALL_BYTES = np.arange(256, dtype=np.uint8)
# value / 256 of every e4m3 pattern; NaN patterns (0x7F, 0xFF) excluded (the cache never stores them)
FINITE = ALL_BYTES[(ALL_BYTES & 0x7F) != 0x7F]
WANT = FINITE.view(ml_dtypes.float8_e4m3fn).astype(np.float64) / 256.0


def test_jnp_decode_is_exact_for_every_e4m3_byte():
  got = np.asarray(triton_backend._e4m3_bits_to_f16(FINITE.view(np.int8)), np.float64)
  np.testing.assert_array_equal(got, WANT)


@pytest.mark.parametrize("k", range(4))
def test_word_plane_ptx_decodes_byte_k_of_two_words(k):
  asm = triton_backend._word_plane_asm(k)
  assert re.findall(r"^\s*(\w+\.b32)", asm, re.M) == ["prmt.b32", "shl.b32", "and.b32"]
  rng = np.random.default_rng(k)
  for i, byte in enumerate(FINITE):
    other = rng.choice(FINITE)
    # byte k of word $1 is `byte`, of word $2 `other`; the other bytes are random garbage incl. NaN patterns
    w1, w2 = (int(x) for x in rng.integers(0, 2**32, 2, dtype=np.uint64))
    w1 = (w1 & ~(0xFF << 8 * k)) | int(byte) << 8 * k
    w2 = (w2 & ~(0xFF << 8 * k)) | int(other) << 8 * k
    shift = triton_backend._PTX_SHIFT                         # the run-time shift operands ($3, $4)
    lanes = _f16_lanes(_run_asm(asm, {"$1": w1, "$2": w2, "$3": shift, "$4": shift})["$0"]).astype(np.float64)
    want_other = other.view(ml_dtypes.float8_e4m3fn).astype(np.float64) / 256.0
    np.testing.assert_array_equal(lanes, [WANT[i], want_other], err_msg=f"byte {byte:#04x} at k={k}")


def test_bytes_ptx_decodes_four_bytes():
  rng = np.random.default_rng(0)
  for _ in range(64):
    quad = rng.choice(FINITE, 4)
    word = int(quad.view(np.uint32)[0])                       # little-endian: element i = byte i
    regs = _run_asm(triton_backend._BYTES_ASM, {"$2": word, "$3": triton_backend._PTX_SHIFT})
    got = np.concatenate([_f16_lanes(regs["$0"]), _f16_lanes(regs["$1"])]).astype(np.float64)
    np.testing.assert_array_equal(got, quad.view(ml_dtypes.float8_e4m3fn).astype(np.float64) / 256.0)
  # every byte value in every position of the register
  for pos in range(4):
    for i, byte in enumerate(FINITE):
      regs = _run_asm(triton_backend._BYTES_ASM, {"$2": int(byte) << 8 * pos, "$3": triton_backend._PTX_SHIFT})
      got = np.concatenate([_f16_lanes(regs["$0"]), _f16_lanes(regs["$1"])]).astype(np.float64)
      assert got[pos] == WANT[i] and not np.delete(got, pos).any()


@pytest.mark.parametrize("config", [dict(fp8_decode="ptx_planes", num_splits=3),
                                    dict(fp8_decode="ptx_tile", block_n=16, num_splits=1),
                                    dict(fp8_decode="ptx_bytes", block_r=32, block_n=64)])
def test_fp8_decode_variants_match_reference(config):
  """Column orders (byte planes vs interleaved tiles vs bytes), one split and several, NaN-poisoned pools,
  empty and partial last pages; Sq 2 causal packs 2 tokens x 20 heads into padded row blocks."""
  q, cache, table, seq_lens = make_problem(11, "fp8_e4m3", [130, 0, 64, 17], 2, 20)
  out, lse = triton_backend.mla_decode(q, cache, table, seq_lens, softmax_scale=SCALE, causal=True,
                                       interpret=True, **config)
  assert_matches(out, lse, *reference(q, cache, table, seq_lens, True), p_bf16=True)


def test_bad_fp8_decode_is_refused():
  q, cache, table, seq_lens = make_problem(1, "fp8_e4m3", [5], 1, 1)
  with pytest.raises(ValueError, match=r"fp8_decode must be one of .*'ptx_planes'.*got 'ptx'"):
    triton_backend.mla_decode(q, cache, table, seq_lens, softmax_scale=SCALE, causal=False, interpret=True,
                              fp8_decode="ptx")
