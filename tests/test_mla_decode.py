"""mla_decode: xla and triton (interpret) backends against a float64 NumPy reference on the dequantized cache.

Every problem NaN-poisons what must never be read: free pages, the tail of each sequence's last page and the
block-table entries past each sequence's pages (they point at poisoned pages). Tolerances are FlashMLA's
(docs/architecture.md §3). Interpret mode is slow on CPU, so the grid of cases is a chosen cover, not a cartesian product.
"""
import logging
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from pallas_kernels import MLAKVCache, mla_decode
from pallas_kernels.mla_decode import api
from pallas_kernels.mla_decode import triton as triton_backend
from pallas_kernels.mla_decode.reference import mla_decode_numpy

SCALE = 576 ** -0.5     # FlashMLA tests: N(0, 1) data, d^-0.5


_write = jax.jit(MLAKVCache.write)


def make_problem(seed, dtype, lens, sq, h, *, page_size=64, extra_pages=3, q_dtype=jnp.bfloat16):
  """A cache holding only the tokens of `lens`, everything else NaN; a shuffled block table; q."""
  rng = np.random.default_rng(seed)
  b = len(lens)
  pages_per_seq = [-(-n // page_size) for n in lens]
  max_pages = max(1, max(pages_per_seq) + 1)                   # >= 1 unused entry per row
  # pool and token counts rounded up to buckets so that cases share compiled executables (CPU time)
  num_pages = -(-(sum(pages_per_seq) + extra_pages) // 8) * 8
  perm = rng.permutation(num_pages)
  used, free = perm[:sum(pages_per_seq)], perm[sum(pages_per_seq):]
  table = np.empty((b, max_pages), np.int32)
  start = 0
  slots = []
  for i, (n, k) in enumerate(zip(lens, pages_per_seq)):
    table[i, :k] = used[start:start + k]
    table[i, k:] = rng.choice(free, max_pages - k)           # unused entries: poisoned pages
    start += k
    slots += [table[i, t // page_size] * page_size + t % page_size for t in range(n)]
  cache = MLAKVCache.allocate(num_pages, page_size=page_size, dtype=dtype)
  nan = jnp.nan
  cache = MLAKVCache(latent=jnp.full_like(cache.latent, nan), rope=jnp.full_like(cache.rope, nan),
                     scale=None if cache.scale is None else jnp.full_like(cache.scale, nan), page_size=page_size)
  t = -(-len(slots) // 512) * 512
  slots += [-1] * (t - len(slots))                             # -1: padding rows that write nothing
  # N(0, 1)-scale data as in FlashMLA's tests, with tiles and tokens of different magnitudes so that each
  # fp8 tile gets its own scale (a scale applied to the wrong tile or token is far outside tolerance).
  tile_mag = np.repeat([0.5, 1.0, 2.0, 0.25], 128)[None, :]
  latent = rng.standard_normal((t, 512)) * tile_mag * rng.choice([0.5, 1.0, 1.5], size=(t, 1))
  cache = _write(cache, jnp.asarray(slots, jnp.int32), jnp.asarray(latent, jnp.float32),
                 jnp.asarray(rng.standard_normal((t, 64)), jnp.float32))
  q = jnp.asarray(rng.standard_normal((b, sq, h, 576)), q_dtype)
  return q, cache, jnp.asarray(table), jnp.asarray(lens, jnp.int32)


def reference(q, cache, table, lens, causal):
  """(out, lse, out_abs) from the float64 NumPy reference on the dequantized cache."""
  lat, rope = cache.dequantize()
  return mla_decode_numpy(np.asarray(q, np.float64), np.asarray(lat), np.asarray(rope), np.asarray(table),
                          np.asarray(lens), softmax_scale=SCALE, causal=causal, page_size=cache.page_size,
                          return_abs=True)


def assert_matches(out, lse, ref_out, ref_lse, ref_abs, *, exact=False, p_bf16=False):
  """docs/architecture.md §3 tolerances: out abs 1e-3 + rel 2/128 and cosine diff 5e-6; lse abs 1e-6 + rel 8/65536.

  p_bf16: the kernel rounds P to bf16 for the P.V product (as FlashMLA does); on sums that cancel that error,
  up to 2^-9 * sum p|v| / l per element, exceeds 1e-3 + 2/128 |out|, so the bound gets 2^-8 * sum p|v| / l.
  """
  out = np.asarray(out, np.float64)
  lse = np.asarray(lse, np.float64)
  assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
  assert not np.isnan(out).any() and not np.isnan(lse).any()
  atol, rtol = (1e-5, 1e-5) if exact else (1e-3, 2 / 128)
  if p_bf16:
    atol = atol + 2.0**-8 * ref_abs
  bad = np.abs(out - ref_out) > atol + rtol * np.abs(ref_out)
  if bad.any():
    i = np.unravel_index(np.argmax(np.abs(out - ref_out) - atol - rtol * np.abs(ref_out)), out.shape)
    raise AssertionError(f"{bad.sum()} of {bad.size} outputs outside tolerance; worst at {i}: got {out[i]}, "
                         f"want {ref_out[i]} (sum p|v|/l = {ref_abs[i]})")
  x, y = out.ravel(), ref_out.ravel()
  denom = (x * x + y * y).sum()
  if denom > 0:
    assert 1 - 2 * (x * y).sum() / denom < 5e-6
  empty = np.isinf(ref_lse)
  np.testing.assert_array_equal(np.isinf(lse), empty)
  assert np.all(lse[empty] > 0)                                  # +inf for queries that see no key
  np.testing.assert_allclose(lse[~empty], ref_lse[~empty], atol=1e-6, rtol=8 / 65536)


# (cache dtype, heads, q_len, lengths, causal): covers lengths {0,1,63,64,65,~1000}, Sq {1,2,4},
# H {1,16,20,128}, both cache dtypes, causal with L < Sq (a query that sees nothing).
CASES = [
    ("fp8_e4m3", 16, 1, [0, 1, 63, 64, 65, 1000], False),
    ("bfloat16", 16, 1, [65, 0, 1000, 1], False),
    ("fp8_e4m3", 20, 2, [1, 63, 64, 65], True),
    ("bfloat16", 128, 1, [65, 1, 0], False),
    ("fp8_e4m3", 128, 4, [64, 3, 130], True),
    ("bfloat16", 1, 4, [63, 65, 4, 2], True),
    ("fp8_e4m3", 1, 2, [1, 200], False),
    ("bfloat16", 20, 4, [1000, 64], True),
]


@pytest.mark.parametrize("backend", ["xla", "triton"])
@pytest.mark.parametrize("dtype,h,sq,lens,causal", CASES, ids=[f"{c[0]}-h{c[1]}-sq{c[2]}-{c[4]}" for c in CASES])
def test_matches_float64_reference(backend, dtype, h, sq, lens, causal):
  q, cache, table, seq_lens = make_problem(hash((dtype, h, sq)) % 1000, dtype, lens, sq, h)
  out, lse = mla_decode(q, cache, table, seq_lens, softmax_scale=SCALE, causal=causal, backend=backend,
                        interpret=True)
  assert out.dtype == jnp.bfloat16 and out.shape == (len(lens), sq, h, 512)
  assert lse.dtype == jnp.float32 and lse.shape == (len(lens), h, sq)
  assert_matches(out, lse, *reference(q, cache, table, seq_lens, causal), p_bf16=backend != "xla")


@pytest.mark.parametrize("config", [dict(num_splits=1), dict(num_splits=5, block_n=64),
                                    dict(block_r=64, fp8_decode="native"),
                                    dict(page_size=16, block_n=16, num_splits=3)])
def test_triton_configs(config):
  """One split (direct output), several (combine, some empty), whole-page chunks, a padded 64-row block with
  the hardware-conversion diagnostic path, small pages."""
  config = dict(config)
  page_size = config.pop("page_size", 64)
  q, cache, table, seq_lens = make_problem(7, "fp8_e4m3", [130, 0, 64, 17], 2, 20, page_size=page_size)
  out, lse = triton_backend.mla_decode(q, cache, table, seq_lens, softmax_scale=SCALE, causal=True,
                                       interpret=True, **config)
  # backend output before the api's contract: an empty sequence must already give 0 / +inf
  assert_matches(out, lse, *reference(q, cache, table, seq_lens, True), p_bf16=True)


def test_float32_cache_is_exact_on_xla_and_refused_by_triton():
  q, cache, table, seq_lens = make_problem(3, "float32", [70, 5], 2, 4, q_dtype=jnp.float32)
  out, lse = mla_decode(q, cache, table, seq_lens, softmax_scale=SCALE, causal=True, backend="xla")
  assert out.dtype == jnp.float32
  assert_matches(out, lse, *reference(q, cache, table, seq_lens, True), exact=True)
  with pytest.raises(ValueError, match="float32"):
    mla_decode(q, cache, table, seq_lens, softmax_scale=SCALE, backend="triton", interpret=True)
  with pytest.raises(ValueError, match="float32"):
    triton_backend.mla_decode(q.astype(jnp.bfloat16), cache, table, seq_lens, softmax_scale=SCALE,
                              causal=False, interpret=True)


@pytest.mark.parametrize("backend", ["xla", "triton"])
def test_jit_and_vmap(backend):
  q, cache, table, seq_lens = make_problem(11, "fp8_e4m3", [65, 1], 1, 16)
  kw = dict(softmax_scale=SCALE, backend=backend, interpret=True)
  f = jax.jit(lambda q, c, t, s: mla_decode(q, c, t, s, **kw))
  out, lse = f(q, cache, table, seq_lens)
  eager_out, eager_lse = mla_decode(q, cache, table, seq_lens, **kw)
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(eager_out, np.float32))
  np.testing.assert_array_equal(np.asarray(lse), np.asarray(eager_lse))
  # vmap over an extra leading axis of q
  q2 = jnp.stack([q, (q * -0.5).astype(q.dtype)])
  vo, vl = jax.jit(jax.vmap(f, in_axes=(0, None, None, None)))(q2, cache, table, seq_lens)
  assert vo.shape == (2, *out.shape) and vl.shape == (2, *lse.shape)
  for i in range(2):
    assert_matches(vo[i], vl[i], *reference(q2[i], cache, table, seq_lens, False), p_bf16=True)
  if backend != "xla":
    return  # folding a batch of caches into one pool is backend-independent; one backend keeps CPU time down
  # vmap over a batch of caches (and their tables and lengths)
  q_b, cache_b, table_b, lens_b = make_problem(12, "fp8_e4m3", [70, 30], 1, 16)   # same pool size
  caches = jax.tree.map(lambda a, b: jnp.stack([a, b]), cache, cache_b)
  vo, vl = jax.vmap(f, in_axes=(0, 0, 0, 0))(jnp.stack([q, q_b]), caches, jnp.stack([table, table_b]),
                                              jnp.stack([seq_lens, lens_b]))
  assert_matches(vo[0], vl[0], *reference(q, cache, table, seq_lens, False), p_bf16=True)
  assert_matches(vo[1], vl[1], *reference(q_b, cache_b, table_b, lens_b, False), p_bf16=True)


@pytest.mark.parametrize("backend", ["xla", "triton"])
def test_q_rope_apart_is_q_whole(backend):
  """q's two parts apart (q_rope=) give the bits of their concatenation, eagerly, under jit and under vmap."""
  q, cache, table, seq_lens = make_problem(13, "fp8_e4m3", [65, 0, 3], 1, 16)
  kw = dict(softmax_scale=SCALE, backend=backend, interpret=True)
  whole = mla_decode(q, cache, table, seq_lens, **kw)
  apart = jax.jit(lambda a, r, c, t, s: mla_decode(a, c, t, s, q_rope=r, **kw))(q[..., :512], q[..., 512:],
                                                                                  cache, table, seq_lens)
  for x, y in zip(whole, apart):
    np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
  q2 = jnp.stack([q, (q * -0.5).astype(q.dtype)])
  vo, vl = jax.vmap(lambda a, r: mla_decode(a, cache, table, seq_lens, q_rope=r, **kw))(q2[..., :512], q2[..., 512:])
  for i in range(2):
    wo, wl = mla_decode(q2[i], cache, table, seq_lens, **kw)
    np.testing.assert_array_equal(np.asarray(vo[i], np.float32), np.asarray(wo, np.float32))
    np.testing.assert_array_equal(np.asarray(vl[i]), np.asarray(wl))


@pytest.mark.parametrize("backend", ["xla", "triton"])
def test_bad_rows_come_back_nan_under_jit(backend):
  """Under jit lengths cannot be checked; rows with a bad length or page index are NaN, others untouched."""
  q, cache, table, seq_lens = make_problem(5, "bfloat16", [70, 10, 10], 1, 16)
  table = table.at[1, 0].set(cache.num_pages + 5)               # a used entry out of range
  seq_lens = seq_lens.at[2].set(table.shape[1] * 64 + 1)         # longer than the table
  f = jax.jit(lambda q, c, t, s: mla_decode(q, c, t, s, softmax_scale=SCALE, backend=backend, interpret=True))
  out, lse = f(q, cache, table, seq_lens)
  out, lse = np.asarray(out, np.float32), np.asarray(lse)
  assert np.isnan(out[1:]).all() and np.isnan(lse[1:]).all()
  assert_matches(out[:1], lse[:1], *reference(q[:1], cache, table[:1], seq_lens[:1], False), p_bf16=True)
  with pytest.raises(ValueError, match="seq_lens must lie in"):
    mla_decode(q, cache, table, seq_lens, softmax_scale=SCALE, backend=backend, interpret=True)


def test_input_errors():
  q, cache, table, seq_lens = make_problem(9, "fp8_e4m3", [5, 6], 1, 4)
  kw = dict(softmax_scale=SCALE, backend="xla")
  with pytest.raises(ValueError, match="576"):
    mla_decode(q[..., :575], cache, table, seq_lens, **kw)
  with pytest.raises(ValueError, match="block_table"):
    mla_decode(q, cache, table[:1], seq_lens, **kw)
  with pytest.raises(ValueError, match="seq_lens"):
    mla_decode(q, cache, table, seq_lens[:1], **kw)
  with pytest.raises(ValueError, match="int32"):
    mla_decode(q, cache, table.astype(jnp.int16), seq_lens, **kw)
  with pytest.raises(ValueError, match="bfloat16"):
    mla_decode(q.astype(jnp.float16), cache, table, seq_lens, **kw)
  with pytest.raises(ValueError, match="softmax_scale"):
    mla_decode(q, cache, table, seq_lens, softmax_scale=-1.0, backend="xla")
  with pytest.raises(ValueError, match="MLAKVCache"):
    mla_decode(q, (cache.latent, cache.rope), table, seq_lens, **kw)
  with pytest.raises(ValueError, match="unknown backend 'flash'"):
    mla_decode(q, cache, table, seq_lens, softmax_scale=SCALE, backend="flash")
  # q's parts apart: q must be the q_nope part and q_rope match it
  with pytest.raises(ValueError, match="with q_rope given, q must be the absorbed q_nope part"):
    mla_decode(q, cache, table, seq_lens, q_rope=q[..., 512:], **kw)
  with pytest.raises(ValueError, match="q_rope must be"):
    mla_decode(q[..., :512], cache, table, seq_lens, q_rope=q[..., 510:], **kw)
  with pytest.raises(ValueError, match="q_rope must be"):
    mla_decode(q[..., :512], cache, table, seq_lens, q_rope=q[:1, ..., 512:], **kw)
  with pytest.raises(ValueError, match="q_rope must be"):
    mla_decode(q[..., :512], cache, table, seq_lens, q_rope=q[..., 512:].astype(jnp.float32), **kw)
  with pytest.raises(ValueError, match="q_rope must be an array"):
    mla_decode(q[..., :512], cache, table, seq_lens, q_rope=[1.0] * 64, **kw)
  with pytest.raises(ValueError, match=r"or its q_nope part \[.., 512\] with q_rope="):
    mla_decode(q[..., :512], cache, table, seq_lens, **kw)


def test_backend_choice_on_cpu(caplog):
  q, cache, table, seq_lens = make_problem(10, "fp8_e4m3", [5], 1, 4)
  api._logged_choices.clear()
  with caplog.at_level(logging.INFO, logger="pallas_kernels"):
    mla_decode(q, cache, table, seq_lens, softmax_scale=SCALE)
    mla_decode(q, cache, table, seq_lens, softmax_scale=SCALE)
    jax.jit(lambda q: mla_decode(q, cache, table, seq_lens, softmax_scale=SCALE))(q)
  lines = [r.getMessage() for r in caplog.records if r.name == "pallas_kernels"]
  assert len(lines) == 1, lines                                  # once per distinct choice, not per call
  assert "'xla'" in lines[0] and "cpu" in lines[0] and "fp8_e4m3" in lines[0]
  # a kernel backend without a GPU and without interpret=True: refused, saying why and what would run
  with pytest.raises(ValueError, match=r"backend 'triton' cannot run: .*CUDA GPU.*would run here: \['xla'"):
    mla_decode(q, cache, table, seq_lens, softmax_scale=SCALE, backend="triton")
  with pytest.raises(ValueError, match="backend 'mosaic_sm90'"):
    mla_decode(q, cache, table, seq_lens, softmax_scale=SCALE, backend="mosaic_sm90")
  avail = pallas_kernels.available_backends("fp8_e4m3")
  assert avail["xla"] is None and "CUDA" in avail["triton"]
  assert pallas_kernels.available_backends("fp8_e4m3", interpret=True)["triton"] is None
  assert "float32" in pallas_kernels.available_backends("float32", interpret=True)["triton"]


def test_resolve_backend_is_the_choice_mla_decode_makes():
  name, reason = pallas_kernels.resolve_backend("auto", "fp8_e4m3", False)
  assert name == "xla" and reason.startswith("auto: platform cpu")
  name, reason = pallas_kernels.resolve_backend("triton", "bfloat16", True, device=jax.devices()[0])
  assert name == "triton" and "requested explicitly" in reason
  with pytest.raises(ValueError, match=r"backend 'triton' cannot run: .*CUDA GPU"):
    pallas_kernels.resolve_backend("triton", "fp8_e4m3", False)
  with pytest.raises(ValueError, match="dtype must be one of"):
    pallas_kernels.resolve_backend("auto", "float16", False)


def test_auto_order_for_gpus():
  """The §6 rule, on synthetic targets: cc >= 9.0 prefers mosaic_sm90, 8.x triton; fallbacks say why."""
  def target(cc, dtype="fp8_e4m3"):
    return api.Target("gpu", "NVIDIA X", cc, dtype, False)
  assert api._auto_order(target((9, 0)))[0][0] == "mosaic_sm90"
  assert api._auto_order(target((8, 0)))[0] == ["triton", "xla"]
  assert api.select_backend("auto", target((8, 6))) == "triton"
  assert api.select_backend("auto", target((8, 0), "float32")) == "xla"
  if "mosaic_sm90" not in api.BACKENDS:
    assert api.select_backend("auto", target((9, 0))) == "triton"
  assert "compute capability >= 8.0" in api.backend_unavailable_reason("triton", target((7, 5)))


_SHARDING_SCRIPT = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    sys.path.insert(0, {tests!r})
    from test_mla_decode import SCALE, make_problem
    from pallas_kernels import mla_decode
    assert jax.device_count() == 8
    q, cache, table, lens = make_problem(21, "fp8_e4m3", [65, 0, 130, 1], 1, 16)
    for backend, axis_type, q_spec in [
        ("xla", AxisType.Auto, P("dp", None, "tp", None)), ("xla", AxisType.Explicit, P(None, None, "tp")),
        ("xla", AxisType.Auto, P(("dp", "tp"))), ("triton", AxisType.Auto, P("dp", None, "tp", None)),
        ("triton", AxisType.Explicit, P("dp"))]:
      mesh = jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(axis_type,) * 2)
      if q_spec[0] == ("dp", "tp"):
        q_, table_, lens_ = (jnp.concatenate([x, x]) for x in (q, table, lens))
      else:
        q_, table_, lens_ = q, table, lens
      f = lambda q, c, t, s: mla_decode(q, c, t, s, softmax_scale=SCALE, backend=backend, interpret=True)
      want_out, want_lse = jax.jit(f)(q_, cache, table_, lens_)
      b_spec = P(q_spec[0])
      args = (jax.device_put(q_, NamedSharding(mesh, q_spec)), jax.device_put(cache, NamedSharding(mesh, P())),
              jax.device_put(table_, NamedSharding(mesh, b_spec)), jax.device_put(lens_, NamedSharding(mesh, b_spec)))
      jf = jax.jit(f)
      out, lse = jf(*args)
      hlo = jf.lower(*args).compile().as_text()
      q_spec4 = tuple(q_spec) + (None,) * (4 - len(q_spec))
      assert tuple(out.sharding.spec) + (None,) * (4 - len(out.sharding.spec)) == q_spec4, out.sharding
      assert "all-gather" not in hlo and "all-to-all" not in hlo, "the kernel must run per shard"
      np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want_out, np.float32), atol=1e-3, rtol=2 / 128)
      np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), rtol=1e-6)
      print("ok", backend, axis_type, q_spec)
""")


def test_sharded_inputs_run_per_shard_without_shard_map():
  """8 CPU devices in a subprocess (the device count must be set before jax starts)."""
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
  script = _SHARDING_SCRIPT.format(tests=os.path.dirname(os.path.abspath(__file__)))
  res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
  assert res.returncode == 0, res.stdout + res.stderr[-4000:]
  assert res.stdout.count("ok ") == 5, res.stdout
