"""The register maps of the swapped kernel's register_dequant (sm90_fp8_operands), checked without a GPU: a NumPy
model of what every thread's inline conversion computes from its loaded registers, placed by the WGMMA layout,
must equal the jnp operands interpret mode uses, and the permutations must be the documented ones."""
import numpy as np
import jax.numpy as jnp
import pytest
from jax.experimental.mosaic import gpu as mgpu

from pallas_kernels.mla_decode import sm90_fp8_operands as ops


def _thread_values(layout, values):
  """{(warp, lane): {(register, element): value}} of `values` held in `layout`."""
  out = {}
  for (warp, lane, reg, e), idx in ops.register_owners(layout.to_mgpu(), values.shape).items():
    out.setdefault((warp, lane), {})[(reg, e)] = values[idx]
  return out


def _place(regs_by_thread, cols=64):
  """{(warp, lane): {(A register, element): value}} -> the [64, cols] array of the WGMMA layout."""
  a = np.full((64, cols), np.nan)
  for (warp, lane, reg, e), (r, c) in ops.register_owners(mgpu.WGMMA_LAYOUT, (64, cols)).items():
    a[r, c] = regs_by_thread[(warp, lane)][(reg, e)]
  return a


def _e4m3_tile(rng, shape):
  return jnp.asarray(rng.standard_normal(shape) * 8, jnp.float32).astype(jnp.float8_e4m3fn)


def test_permutations_are_bijections_and_match_the_reshapes():
  assert sorted(ops.qk_dims()) == list(range(512)) and sorted(ops.pv_rows()) == list(range(512))
  x = np.arange(512.0)
  np.testing.assert_array_equal(np.asarray(ops.q_in_qk_order(jnp.asarray(x))), ops.qk_dims())
  np.testing.assert_array_equal(ops.pv_rows()[np.asarray(ops.row_of_dim())], x)
  np.testing.assert_array_equal(np.asarray(ops.row_of_dim()), np.argsort(ops.pv_rows()))
  dims = np.random.default_rng(3).permutation(512).astype(np.int32)[:128]      # any dims, as the merge kernel asks
  np.testing.assert_array_equal(np.asarray(ops.row_of_dim(jnp.asarray(dims))), np.argsort(ops.pv_rows())[dims])
  # QK: a thread's 16 loaded bytes of a chunk are its four k-steps; P.V: 8 bytes of a half are its rows of 4 blocks
  k = ops.qk_dims()[:64]
  assert list(k[[2, 3, 10, 11]]) == [16, 17, 18, 19]          # lane c = 1, k-step 0 -> bytes 16 .. 19
  assert [int(ops.pv_rows()[64 * b + 16 + 3]) for b in range(4)] == [88, 90, 92, 94]   # warp 1, g 3, h 0


@pytest.mark.parametrize("tile", [0, 3])
def test_qk_register_map_builds_the_jnp_operands(tile):
  rng = np.random.default_rng(tile)
  raw = _e4m3_tile(rng, (64, 128))
  scales = 2.0 ** rng.integers(-4, 4, size=64)
  vals = _thread_values(ops.QK_TILE_LAYOUT, np.asarray(raw.astype(jnp.float32)))
  want = ops.qk_operands_jnp(raw, jnp.asarray(scales, jnp.float32))
  for q in range(2):
    regs = {}
    for (warp, lane), held in vals.items():
      rows = (16 * warp + lane // 4, 16 * warp + lane // 4 + 8)
      for (qq, reg), (src, byte, h) in ops.qk_register_map().items():
        if qq == q:
          for e in range(2):
            regs.setdefault((warp, lane), {})[(reg, e)] = held[(src, byte + e)] * scales[rows[h]]
    np.testing.assert_array_equal(_place(regs), np.asarray(want[q], np.float64))


def _prmt(x: int, y: int, selector: int) -> int:
  """PTX prmt.b32 (default mode): result byte n = byte (selector nibble n) of the 8 bytes y:x."""
  both = x | y << 32
  return sum(((both >> (8 * ((selector >> (4 * n)) & 7))) & 0xFF) << (8 * n) for n in range(4))


def _e4m3_value(code: int) -> float:
  return float(np.asarray(jnp.asarray(np.uint8(code)).view(jnp.float8_e4m3fn).astype(jnp.float32)))


@pytest.mark.parametrize("half", [0, 1])
def test_pv_instructions_build_the_jnp_operands(half):
  """The bytes each thread's permutes and conversions take, simulated instruction by instruction on its loaded
  words (the map alone cannot catch a wrong selector or half: the first GPU run had one)."""
  rng = np.random.default_rng(10 + half)
  raw = _e4m3_tile(rng, (64, 256))
  scales = 2.0 ** rng.integers(-4, 4, size=(64, 4))
  byte_of = _thread_values(ops.PV_HALF_LAYOUT, np.asarray(raw.view(jnp.uint8)).astype(np.int64))
  want = ops.pv_operands_jnp(raw, jnp.asarray(scales[:, 2 * half:2 * half + 2], jnp.float32))
  for b in range(4):
    regs = {}
    for (warp, lane), held in byte_of.items():
      tile = 2 * half + warp // 2
      word = lambda reg, k: sum(int(held[(reg, 4 * k + n)]) << (8 * n) for n in range(4))
      for (bb, reg), (x_reg, y_reg, k, selector, pick, tok_base) in ops.pv_instructions().items():
        if bb == b:
          tok = 2 * (lane % 4) + tok_base
          pair = (_prmt(word(x_reg, k), word(y_reg, k), selector) >> (16 * pick)) & 0xFFFF
          regs.setdefault((warp, lane), {})[(reg, 0)] = _e4m3_value(pair & 0xFF) * scales[tok, tile]
          regs[(warp, lane)][(reg, 1)] = _e4m3_value(pair >> 8) * scales[tok + 1, tile]
    np.testing.assert_array_equal(_place(regs), np.asarray(want[b], np.float64))


def test_maps_hold_python_ints():
  """The GPU conversions build MLIR constants and register indices from these maps: NumPy integers there fail
  only at compile time on a GPU (an MLIR attribute error), so the maps must hold plain ints."""
  flat = lambda v: [x for y in v for x in (y if isinstance(y, tuple) else (y,))]
  for table in (ops.qk_register_map(), ops.pv_instructions()):
    for key, value in table.items():
      assert all(type(x) is int for x in flat(key) + flat(value)), (key, value)
