"""MLAKVCache: formats, fp8 quantization bounds, writes under jit with donation, pytree behaviour."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from pallas_kernels import MLAKVCache
from pallas_kernels.mla_decode.cache import cache_bytes_per_token, dequantize_fp8, quantize_fp8


def _rand(rng, shape, scale=1.0):
  return jnp.asarray(rng.standard_normal(shape) * scale, jnp.float32)


@pytest.mark.parametrize("dtype,bpt,lat_dt,rope_dt,has_scale", [
    ("bfloat16", 1152, jnp.bfloat16, jnp.bfloat16, False),
    ("fp8_e4m3", 656, jnp.float8_e4m3fn, jnp.bfloat16, True),
    ("float32", 2304, jnp.float32, jnp.float32, False),
])
def test_allocate_layout(dtype, bpt, lat_dt, rope_dt, has_scale):
  c = MLAKVCache.allocate(5, page_size=32, dtype=dtype)
  assert c.dtype == dtype and c.num_pages == 5 and c.page_size == 32
  assert c.latent.shape == (5, 32, 512) and c.latent.dtype == lat_dt
  assert c.rope.shape == (5, 32, 64) and c.rope.dtype == rope_dt
  assert (c.scale is not None) == has_scale
  if has_scale:
    assert c.scale.shape == (5, 32, 4) and c.scale.dtype == jnp.float32
  assert c.bytes_per_token == bpt == cache_bytes_per_token(dtype)
  assert MLAKVCache.allocate(3).page_size == 64


def test_allocate_rejects_bad_arguments():
  with pytest.raises(ValueError, match="dtype must be one of"):
    MLAKVCache.allocate(4, dtype="float16")
  with pytest.raises(ValueError, match="num_pages"):
    MLAKVCache.allocate(0)
  with pytest.raises(ValueError, match="page_size"):
    MLAKVCache.allocate(4, page_size=0)


def test_quantize_fp8_scales_are_powers_of_two_and_bound_error():
  rng = np.random.default_rng(0)
  # tiles of very different magnitudes, including an all-zero tile and tiny values near the 1e-4 floor
  mags = np.array([1e-9, 1e-3, 1.0, 3e4], np.float32)
  x = rng.standard_normal((64, 4, 128)).astype(np.float32) * mags[None, :, None]
  x[3, 2] = 0.0
  x[5, 1, :] = 448.0 * 2.0**-3      # amax/448 exactly a power of two: scale must be exactly 2^-3
  x = jnp.asarray(x.reshape(64, 512))
  values, scale = jax.jit(quantize_fp8)(x)
  assert values.dtype == jnp.float8_e4m3fn and scale.shape == (64, 4) and scale.dtype == jnp.float32
  scale = np.asarray(scale, np.float64)
  log2 = np.log2(scale)
  np.testing.assert_array_equal(log2, np.round(log2))                       # powers of two
  amax = np.abs(np.asarray(x, np.float64)).reshape(64, 4, 128).max(-1)
  ratio = np.maximum(amax / 448.0, 1e-4)
  assert np.all(scale >= ratio * (1 - 1e-6)) and np.all(scale / 2 < ratio)  # the smallest such power
  assert scale[5, 1] == 2.0**-3 and scale[3, 2] == 2.0**-13
  v = np.asarray(values.astype(jnp.float32), np.float64)
  assert np.all(np.isfinite(v)) and np.abs(v).max() <= 448.0
  deq = np.asarray(dequantize_fp8(values, jnp.asarray(scale, jnp.float32)), np.float64).reshape(64, 4, 128)
  xs = np.asarray(x, np.float64).reshape(64, 4, 128)
  # e4m3: 3 mantissa bits -> relative rounding error <= 2^-4 for normals; subnormal step is 2^-9 * scale
  bound = 2.0**-4 * np.abs(xs) + 2.0**-10 * scale[..., None]
  assert np.all(np.abs(deq - xs) <= bound * (1 + 1e-6))
  # and it is not trivially loose: typical error is far below the bound for normal-range tiles
  normal_rows = np.arange(64) != 3                               # row 3's tile 2 is all zeros
  rel = np.abs(deq - xs)[normal_rows, 2] / np.abs(xs[normal_rows, 2])
  assert 1e-3 < np.median(rel) < 2.0**-4


@pytest.mark.parametrize("dtype", ["bfloat16", "fp8_e4m3", "float32"])
def test_write_under_jit_with_donation(dtype):
  rng = np.random.default_rng(1)
  cache = MLAKVCache.allocate(4, page_size=16, dtype=dtype)
  slots = jnp.array([0, 17, -1, 63, 40], jnp.int32)           # -1: a padding row, skipped
  latent, rope = _rand(rng, (5, 512)), _rand(rng, (5, 64))
  step = jax.jit(lambda c, s, l, r: c.write(s, l, r), donate_argnums=0)
  new = step(cache, slots, latent, rope)
  assert isinstance(new, MLAKVCache) and new.dtype == dtype and new.page_size == 16
  lat, rp = (np.asarray(a) for a in new.dequantize())
  lat, rp = lat.reshape(64, 512), rp.reshape(64, 64)
  written = [0, 17, 63, 40]
  src = [0, 1, 3, 4]
  want_lat = np.asarray(latent)[src]
  if dtype == "fp8_e4m3":
    values, scale = quantize_fp8(latent[jnp.array(src)])
    want_lat = np.asarray(dequantize_fp8(values, scale))
  elif dtype == "bfloat16":
    want_lat = np.asarray(latent[jnp.array(src)].astype(jnp.bfloat16).astype(jnp.float32))
  np.testing.assert_array_equal(lat[written], want_lat)
  rope_dt = jnp.float32 if dtype == "float32" else jnp.bfloat16
  np.testing.assert_array_equal(rp[written], np.asarray(rope[jnp.array(src)].astype(rope_dt), np.float32))
  untouched = np.setdiff1d(np.arange(64), written)
  assert np.all(lat[untouched] == 0) and np.all(rp[untouched] == 0)      # the -1 row wrote nothing


@pytest.mark.parametrize("dtype", pallas_kernels.CACHE_DTYPES)
def test_gather_reads_the_named_pages_dequantized(dtype):
  rng = np.random.default_rng(3)
  c = MLAKVCache.allocate(6, page_size=4, dtype=dtype)
  c = c.write(jnp.arange(24, dtype=jnp.int32), _rand(rng, (24, 512), 3.0), _rand(rng, (24, 64)))
  latent_all, rope_all = c.dequantize()                               # [6, 4, 512], [6, 4, 64] float32
  table = jnp.asarray([[5, 0, 2], [1, 1, 4]], jnp.int32)
  latent, rope = c.gather(table)
  assert latent.shape == (2, 12, 512) and rope.shape == (2, 12, 64)
  assert latent.dtype == (jnp.float32 if dtype == "fp8_e4m3" else c.latent.dtype)   # fp8 comes dequantized
  np.testing.assert_array_equal(np.asarray(latent, np.float32), np.asarray(latent_all[table].reshape(2, 12, 512)))
  np.testing.assert_array_equal(np.asarray(rope, np.float32), np.asarray(rope_all[table].reshape(2, 12, 64)))
  assert c.gather(table, jnp.bfloat16)[0].dtype == jnp.bfloat16


def test_write_then_overwrite_and_bad_shapes():
  rng = np.random.default_rng(2)
  c = MLAKVCache.allocate(2, page_size=16, dtype="bfloat16")
  c = c.write(jnp.array([3], jnp.int32), _rand(rng, (1, 512)), _rand(rng, (1, 64)))
  second = _rand(rng, (1, 512))
  c = c.write(jnp.array([3], jnp.int32), second, _rand(rng, (1, 64)))
  np.testing.assert_array_equal(np.asarray(c.latent[0, 3], np.float32),
                                np.asarray(second[0].astype(jnp.bfloat16), np.float32))
  with pytest.raises(ValueError, match="latent must be"):
    c.write(jnp.array([1, 2], jnp.int32), _rand(rng, (2, 500)), _rand(rng, (2, 64)))
  with pytest.raises(ValueError, match="rope must be"):
    c.write(jnp.array([1, 2], jnp.int32), _rand(rng, (2, 512)), _rand(rng, (3, 64)))
  with pytest.raises(ValueError, match="slots"):
    c.write(jnp.array([[1, 2]], jnp.int32), _rand(rng, (2, 512)), _rand(rng, (2, 64)))


def test_pytree_and_validation():
  c = MLAKVCache.allocate(3, page_size=16, dtype="fp8_e4m3")
  leaves, treedef = jax.tree_util.tree_flatten(c)
  assert len(leaves) == 3                                       # latent, rope, scale; page_size is static
  again = jax.tree_util.tree_unflatten(treedef, leaves)
  assert again.page_size == 16 and again.dtype == "fp8_e4m3"
  assert len(jax.tree_util.tree_leaves(MLAKVCache.allocate(3, dtype="bfloat16"))) == 2
  out = jax.jit(lambda cache: jax.tree.map(lambda x: x + 0, cache))(c)
  assert out.page_size == 16
  with pytest.raises(ValueError, match="scale"):
    dataclasses.replace(c, scale=None).validate()
  with pytest.raises(ValueError, match="page_size"):
    dataclasses.replace(c, page_size=32).validate()
  with pytest.raises(ValueError, match="rope"):
    dataclasses.replace(c, rope=c.rope.astype(jnp.float32)).validate()
