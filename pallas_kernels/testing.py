"""Test helpers for the pallas_kernels ops: problems that poison what must never be read, and the tolerance check.

For mla_decode: random_problem builds a problem on the default device (large shapes are cheap): a cache whose free
pages, tail slots and unused block-table targets are all NaN, a shuffled block table and a random q; compare()
applies the op's tolerances (docs/architecture.md §3). Used by tests/ and scripts/check_mla_gpu.py; no kernel
imports this module.
"""
from __future__ import annotations

import statistics
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.mla_decode.cache import MLAKVCache, quantize_fp8

PAGE = 64


def random_problem(seed: int, *, lens, sq: int, heads: int, dtype: str, extra_pages: int = 3):
  """(q bf16 [B,Sq,H,576], cache, block_table int32 [B, max_pages], seq_lens int32 [B]) on the default device.

  Only the slots of `lens` hold data; every other slot of the pool is NaN (latent, rope and fp8 scale), and each
  row's table entries past its pages point at NaN pages. Tiles and tokens get different magnitudes so a scale
  applied to the wrong tile or token shows up.
  """
  lens = np.asarray(lens, np.int32)
  rng = np.random.default_rng(seed)
  b = len(lens)
  pages_per_seq = -(-lens // PAGE)
  max_pages = int(max(1, pages_per_seq.max() + 1))
  used_total = int(pages_per_seq.sum())
  num_pages = used_total + extra_pages
  perm = rng.permutation(num_pages).astype(np.int32)
  used, free = perm[:used_total], perm[used_total:]
  table = np.empty((b, max_pages), np.int32)
  slot_ok = np.zeros((num_pages, PAGE), bool)
  start = 0
  for i, (n, k) in enumerate(zip(lens, pages_per_seq)):
    table[i, :k] = used[start:start + k]
    table[i, k:] = rng.choice(free, max_pages - k)
    start += k
    for j in range(k):
      slot_ok[table[i, j], :min(PAGE, n - j * PAGE)] = True
  k1, k2, k3, k4 = jax.random.split(jax.random.key(seed), 4)
  tile_mag = jnp.repeat(jnp.array([0.5, 1.0, 2.0, 0.25], jnp.float32), 128)
  tok_mag = jax.random.choice(k4, jnp.array([0.5, 1.0, 1.5], jnp.float32), (num_pages, PAGE, 1))
  latent = jax.random.normal(k1, (num_pages, PAGE, 512), jnp.float32) * tile_mag * tok_mag
  rope = jax.random.normal(k2, (num_pages, PAGE, 64), jnp.float32)
  ok = jnp.asarray(slot_ok)[..., None]
  nan = jnp.float32(jnp.nan)
  rope = jnp.where(ok, rope, nan).astype(jnp.bfloat16)
  if dtype == "fp8_e4m3":
    values, scale = quantize_fp8(latent)
    values = jnp.where(ok, values.astype(jnp.float32), nan).astype(jnp.float8_e4m3fn)
    cache = MLAKVCache(latent=values, rope=rope, scale=jnp.where(ok, scale, nan), page_size=PAGE)
  elif dtype == "bfloat16":
    cache = MLAKVCache(latent=jnp.where(ok, latent, nan).astype(jnp.bfloat16), rope=rope, scale=None,
                       page_size=PAGE)
  else:
    raise ValueError(f"dtype must be 'bfloat16' or 'fp8_e4m3', got {dtype!r}")
  q = jax.random.normal(k3, (b, sq, heads, 576), jnp.float32).astype(jnp.bfloat16)
  return q, cache, jnp.asarray(table), jnp.asarray(lens)


def compare(out, lse, ref_out, ref_lse, ref_abs=None) -> dict:
  """docs/architecture.md §3 tolerances against a reference: out |d| <= 1e-3 + 2/128 |ref| and cosine diff < 5e-6
  (half FlashMLA's 1e-5); lse |d| <= 1e-6 + 8/65536 |ref| where finite, and +inf exactly where the reference has
  +inf. ref_abs (sum p|v| / l per element, mla_decode_numpy(return_abs=True)) is for a kernel that rounds P to
  bf16: its per-element bound widens by 2^-8 ref_abs (§3). Returns the measured errors and 'ok'."""
  out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
  ref_out = np.asarray(jnp.asarray(ref_out, jnp.float32), np.float64)
  lse, ref_lse = np.asarray(lse, np.float64), np.asarray(ref_lse, np.float64)
  d = np.abs(out - ref_out)
  widen = 0.0 if ref_abs is None else 2.0 ** -8 * np.asarray(ref_abs, np.float64)
  x, y = out.ravel(), ref_out.ravel()
  denom = (x * x + y * y).sum()
  cos_diff = float(1 - 2 * (x * y).sum() / denom) if denom > 0 else 0.0
  fin = np.isfinite(ref_lse)
  lse_d = np.abs(lse[fin] - ref_lse[fin]) if fin.any() else np.zeros(1)
  res = dict(
      out_nan=int(np.isnan(out).sum()), out_max_abs_err=float(np.nanmax(d)) if d.size else 0.0,
      out_tol_violations=int((~(d <= 1e-3 + widen + 2 / 128 * np.abs(ref_out))).sum()), cos_diff=cos_diff,
      lse_nan=int(np.isnan(lse).sum()), lse_max_abs_err=float(lse_d.max()),
      lse_tol_violations=int((~(lse_d <= 1e-6 + 8 / 65536 * np.abs(ref_lse[fin]))).sum()) if fin.any() else 0,
      lse_inf_match=bool(np.array_equal(np.isposinf(lse), np.isposinf(ref_lse))))
  res["ok"] = (res["out_nan"] == 0 and res["out_tol_violations"] == 0 and cos_diff < 5e-6 and res["lse_nan"] == 0
               and res["lse_tol_violations"] == 0 and res["lse_inf_match"])
  return res


def time_calls(fn, arg_sets, *, min_batch_s=0.05, batches=5, max_calls=2000) -> float:
  """Median seconds per call: batches of back-to-back async calls, rotating over arg_sets, synced at the end."""
  jax.block_until_ready(fn(*arg_sets[0]))              # compile + warm up
  jax.block_until_ready(fn(*arg_sets[-1]))
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*arg_sets[0]))
  one = max(time.perf_counter() - t0, 1e-6)
  n = max(len(arg_sets), min(max_calls, int(min_batch_s / one)))
  samples = []
  for _ in range(batches):
    out = None
    t0 = time.perf_counter()
    for i in range(n):
      out = fn(*arg_sets[i % len(arg_sets)])
    jax.block_until_ready(out)
    samples.append((time.perf_counter() - t0) / n)
  return statistics.median(samples)


def device_time(fn, *args, iters: int = 20) -> dict:
  """Median device time of fn(*args) (jitted; warmed up here).

  CUPTI (jax.experimental.mosaic.gpu.profiler.measure) gives per-kernel times: 'us' is the median total over
  iterations, 'kernels' the median of each kernel. Without CUPTI: wall clock over `iters` back-to-back calls.
  """
  jax.block_until_ready(fn(*args))
  try:
    from jax.experimental.mosaic.gpu import profiler
    _, runs = profiler.measure(fn, aggregate=False, iterations=iters)(*args)
    if not runs:
      raise RuntimeError("no kernels recorded")
    totals = [sum(t for _, t in run) for run in runs]
    names = [name for name, _ in runs[0]]
    per_kernel = {}
    for i, name in enumerate(names):
      per_kernel[f"{i}:{name[:60]}"] = statistics.median(run[i][1] for run in runs if len(run) == len(names)) * 1e3
    return dict(us=statistics.median(totals) * 1e3, method="cupti", kernels=per_kernel)
  except Exception as e:  # noqa: BLE001 - CUPTI unavailable: fall back to the wall clock
    t0 = time.perf_counter()
    for _ in range(iters):
      r = fn(*args)
    jax.block_until_ready(r)
    return dict(us=(time.perf_counter() - t0) / iters * 1e6, method=f"wallclock ({type(e).__name__}: {e})"[:200])


def copy_ceiling_gbps(nbytes=2 << 30) -> float:
  """Device copy bandwidth: y = x + 1 on a 2 GiB int32 buffer counts 2 * nbytes moved."""
  xs = [jnp.full((nbytes // 4,), i, jnp.int32) for i in range(2)]
  f = jax.jit(lambda x: x + 1)
  return 2 * nbytes / time_calls(f, [(x,) for x in xs], min_batch_s=0.2) / 1e9


def commit_id(given: str | None = None) -> str:
  """The commit a benchmark records: `given` (--commit), else the checkout's short HEAD, else "unknown" (the
  device machine's copy of the tree has no .git)."""
  if given:
    return given
  try:
    return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True,
                                   stderr=subprocess.DEVNULL).strip()
  except Exception:  # noqa: BLE001 - no git, or not a checkout
    return "unknown"
