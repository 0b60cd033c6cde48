"""Benchmark pallas_kernels.mla_decode on the local GPU: every available backend, copy ceiling in the same run.

  python scripts/bench_mla.py [--quick] [--backends triton,xla] [--sweep] [--out results.json] [--commit SHA]
  python scripts/bench_mla.py --quick --backends mosaic_sm90 --mosaic-kernel both --no-check   # swapped vs rows

Steps: (1) HBM copy bandwidth (bytes read + written) as the ceiling; (2) correctness of every kernel backend
against the float64 NumPy reference on NaN-poisoned caches; (3) optional config sweep of the triton kernel;
(4) the grid b {32,128} x h {16,128} x L {4096,16384} x Sq {1,2} x cache {bf16,fp8} x lengths {uniform,
ragged}: microseconds per call (median of 5 timed batches, each call on one of two input sets in turn so the
L2 does not serve the cache), effective GB/s (bytes = sum(L) * 656 fp8 or * 1152 bf16), TFLOP/s
(2 * Sq * h * sum(L) * 1088) and % of the copy ceiling; mosaic_sm90 twice, as a whole call and given the decode
step's split-KV schedule (`mosaic_sm90:<kernel>+step_schedule`: one layer's cost in a step, which computes the
schedule once for all layers, as FlashMLA times its kernel after get_mla_metadata). Prints a table last; writes
JSON (device, jax version, git commit) to --out, else $OUT/mla_bench.json, else bench/results/mla_<device>.json.
"""
from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import platform
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import MLAKVCache, available_backends, mla_decode, mla_decode_schedule
from pallas_kernels.mla_decode import mosaic_sm90
from pallas_kernels.mla_decode import triton as triton_backend
from pallas_kernels.mla_decode.api import apply_output_contract
from pallas_kernels.mla_decode.cache import cache_bytes_per_token, quantize_fp8
from pallas_kernels.mla_decode.reference import mla_decode_numpy
from pallas_kernels.testing import copy_ceiling_gbps, time_calls

PAGE = 64
FLOPS_PER_QK_TOKEN = 2 * (576 + 512)


# ---- problems ------------------------------------------------------------------------------------------------
def make_cache(key, num_pages, dtype, *, poison_from=None):
  """A pool of num_pages random pages; pages >= poison_from (if given) are NaN."""
  k1, k2 = jax.random.split(key)
  latent = jax.random.normal(k1, (num_pages * PAGE, 512), jnp.float32)
  rope = jax.random.normal(k2, (num_pages, PAGE, 64), jnp.float32).astype(jnp.bfloat16)
  if dtype == "fp8_e4m3":
    values, scale = quantize_fp8(latent)
    cache = MLAKVCache(latent=values.reshape(num_pages, PAGE, 512), rope=rope,
                       scale=scale.reshape(num_pages, PAGE, 4), page_size=PAGE)
  else:
    cache = MLAKVCache(latent=latent.astype(jnp.bfloat16).reshape(num_pages, PAGE, 512), rope=rope, scale=None,
                       page_size=PAGE)
  if poison_from is not None:
    bad = (jnp.arange(num_pages) >= poison_from)[:, None, None]
    cache = jax.tree.map(lambda x: jnp.where(bad, jnp.full((), jnp.nan, x.dtype), x), cache)
  return cache


_make_cache = jax.jit(make_cache, static_argnums=(1, 2), static_argnames=("poison_from",))


def make_inputs(seed, b, h, sq, max_len, dtype, lengths):
  """(q, cache, block_table, seq_lens) with each sequence's pages scattered over a shuffled pool."""
  rng = np.random.default_rng(seed)
  max_pages = max_len // PAGE
  if lengths == "uniform":
    lens = np.full(b, max_len, np.int32)
  else:  # ragged: uniform in [1, max_len]
    lens = rng.integers(1, max_len + 1, size=b).astype(np.int32)
  table = rng.permutation(b * max_pages).reshape(b, max_pages).astype(np.int32)
  cache = _make_cache(jax.random.key(seed), b * max_pages, dtype)
  q = jax.random.normal(jax.random.key(seed + 1), (b, sq, h, 576), jnp.float32).astype(jnp.bfloat16)
  return (q, cache, jnp.asarray(table), jnp.asarray(lens)), int(lens.sum())


# ---- correctness on the device -------------------------------------------------------------------------------
def check_backend(backend, seed=0) -> list[dict]:
  """Kernel vs float64 reference on poisoned caches (same bounds as tests/test_mla_decode.py)."""
  scale = 576 ** -0.5
  rows = []
  for dtype, h, sq, lens, causal in [("fp8_e4m3", 16, 1, [0, 1, 63, 64, 65, 1000, 4096], False),
                                     ("bfloat16", 16, 1, [4096, 65, 0, 1], False),
                                     ("fp8_e4m3", 128, 2, [1000, 64, 3, 2049], True),
                                     ("bfloat16", 20, 4, [777, 64], True),
                                     ("fp8_e4m3", 1, 1, [5000], False)]:
    rng = np.random.default_rng(seed)
    b = len(lens)
    need = [-(-n // PAGE) for n in lens]
    max_pages = max(need) + 1
    used = sum(need)
    pool = used + 8
    perm = rng.permutation(used)
    table = np.empty((b, max_pages), np.int32)
    start = 0
    for i, k in enumerate(need):
      table[i, :k] = perm[start:start + k]
      table[i, k:] = rng.integers(used, pool, max_pages - k)   # unused entries -> poisoned pages
      start += k
    cache = _make_cache(jax.random.key(seed), pool, dtype, poison_from=used)
    # NaN also in the tail slots of each sequence's last page
    tail = np.zeros((pool, PAGE), bool)
    for i, n in enumerate(lens):
      if n % PAGE:
        tail[table[i, n // PAGE], n % PAGE:] = True
    tail = jnp.asarray(tail)[..., None]
    cache = jax.tree.map(lambda x: jnp.where(tail, jnp.full((), jnp.nan, x.dtype), x), cache)
    q = jax.random.normal(jax.random.key(seed + 7), (b, sq, h, 576), jnp.float32).astype(jnp.bfloat16)
    seq_lens = jnp.asarray(lens, jnp.int32)
    out, lse = jax.jit(lambda q, c, t, s: mla_decode(q, c, t, s, softmax_scale=scale, causal=causal,
                                                     backend=backend))(q, cache, jnp.asarray(table), seq_lens)
    lat, rope = cache.dequantize()
    ref_out, ref_lse, ref_abs = mla_decode_numpy(
        np.asarray(q, np.float64), np.asarray(lat), np.asarray(rope), table, np.asarray(lens),
        softmax_scale=scale, causal=causal, page_size=PAGE, return_abs=True)
    out, lse = np.asarray(out, np.float64), np.asarray(lse, np.float64)
    nan = bool(np.isnan(out).any() or np.isnan(lse).any())
    err = np.abs(out - ref_out)
    p_bf16 = backend != "xla"
    bound = 1e-3 + (2.0**-8 * ref_abs if p_bf16 else 0) + 2 / 128 * np.abs(ref_out)
    x, y = out.ravel(), ref_out.ravel()
    cos = float(1 - 2 * (x * y).sum() / max((x * x + y * y).sum(), 1e-30))
    fin = np.isfinite(ref_lse)
    lse_ok = bool(np.array_equal(np.isinf(lse), ~fin) and np.allclose(lse[fin], ref_lse[fin], atol=1e-6,
                                                                        rtol=8 / 65536))
    ok = (not nan) and bool((err <= bound).all()) and cos < 5e-6 and lse_ok
    rows.append(dict(backend=backend, dtype=dtype, h=h, sq=sq, lens=lens, causal=causal, ok=ok, nan=nan,
                     max_abs_err=float(err.max()), cos_diff=cos,
                     max_lse_err=float(np.abs(lse[fin] - ref_lse[fin]).max()) if fin.any() else 0.0))
  return rows


# ---- main ----------------------------------------------------------------------------------------------------
GRID = dict(b=(32, 128), h=(16, 128), L=(4096, 16384), sq=(1, 2), dtype=("bfloat16", "fp8_e4m3"),
            lengths=("uniform", "ragged"))
QUICK = dict(b=(128,), h=(16, 128), L=(4096,), sq=(1,), dtype=("bfloat16", "fp8_e4m3"), lengths=("uniform",))
# (shape, configs) timed by --sweep: the triton kernel's knobs around its defaults.
SWEEP = [
    # fp8 h16: {} = default (ptx_planes r16 n64 w4 stages 2); n32 stages 1 = 168 registers (3 programs per SM,
    # hence 3 splits); int n32 / int n64 = the 9d5d632 default / best, as anchors
    ((128, 16, 4096, "fp8_e4m3"),
     [{}, dict(block_n=32), dict(num_stages=1), dict(block_n=32, num_stages=1, num_splits=3),
      dict(block_n=32, num_stages=1), dict(num_splits=4), dict(num_stages=3), dict(block_n=16),
      dict(fp8_decode="int", block_n=32), dict(fp8_decode="int"), dict(fp8_decode="ptx_tile", block_n=32),
      dict(fp8_decode="ptx_bytes", block_n=32)]),
    ((128, 16, 4096, "bfloat16"), [dict(block_n=32), dict(block_n=64), dict(num_splits=1), dict(num_splits=4)]),
    # fp8 h128: {} = default (ptx_bytes r64 n32 w8); int r64 n16 w4 = the 9d5d632 best (1,940 us)
    ((128, 128, 4096, "fp8_e4m3"),
     [{}, dict(block_n=16), dict(block_r=32), dict(fp8_decode="ptx_planes", block_r=16, num_warps=4),
      dict(fp8_decode="ptx_planes", block_r=16, num_warps=4, block_n=64),
      dict(fp8_decode="ptx_planes", block_r=16, num_warps=4, block_n=64, num_stages=1),
      dict(fp8_decode="ptx_tile"), dict(fp8_decode="int", block_n=16, num_warps=4, num_splits=1)]),
    ((128, 128, 4096, "bfloat16"), [dict(block_r=r) for r in (16, 32, 64)]),
]


def _grid_entries(backends, mosaic_kernel: str):
  """(backend, kernel) pairs timed for one grid point: mosaic_sm90 once per requested kernel (None = the op's)."""
  for name in backends:
    if name != "mosaic_sm90" or mosaic_kernel == "auto":
      yield name, None if name != "mosaic_sm90" else "auto"
      if name == "mosaic_sm90":
        yield name, STEP      # the same call given the decode step's schedule: one layer's cost in a step
      continue
    for kernel in (("swapped", "rows") if mosaic_kernel == "both" else (mosaic_kernel,)):
      yield name, kernel


def _label(name: str, kernel) -> str:
  return name if kernel is None else f"{name}:{kernel}"


# mosaic_sm90 with the split-KV schedule computed outside the timed call, as a decode step computes it once for all
# its layers (mla_decode_schedule; FlashMLA times its kernel after get_mla_metadata the same way)
STEP = "step_schedule"


def _grid_fn(name: str, kernel, *, causal: bool):
  if kernel in (None, "auto"):
    return jax.jit(lambda q, c, t, s: mla_decode(q, c, t, s, softmax_scale=0.1, causal=causal, backend=name))
  if kernel == STEP:
    return jax.jit(lambda q, c, t, s, sched: mla_decode(q, c, t, s, softmax_scale=0.1, causal=causal,
                                                        backend=name, schedule=sched))

  def forced(q, c, t, s):                          # the op's steps for one device, with the kernel forced
    out, lse = mosaic_sm90.mla_decode(q, c, t, s, softmax_scale=0.1, causal=causal, kernel=kernel)
    return apply_output_contract(out, lse, c, t, s)
  return jax.jit(forced)


def git_commit() -> str:
  try:
    return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                          cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
  except Exception:  # noqa: BLE001 - the device machine gets a copy of the tree without .git
    return "unknown"


_log_records: list[str] = []


class _Keep(logging.Handler):
  def emit(self, record):
    _log_records.append(record.getMessage())


def main(argv=None):
  logging.basicConfig(level=logging.WARNING)
  logging.getLogger("pallas_kernels").setLevel(logging.INFO)
  logging.getLogger("pallas_kernels").addHandler(_Keep())
  t_start = time.perf_counter()
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--quick", action="store_true", help="b128, L4096, Sq1, uniform only")
  ap.add_argument("--backends", default=None, help="comma list (default: every available one)")
  ap.add_argument("--sweep", action="store_true", help="also time triton kernel configurations")
  ap.add_argument("--no-check", action="store_true", help="skip the correctness check")
  ap.add_argument("--batches", default=None, help="comma list overriding the grid's batch sizes (split long runs)")
  ap.add_argument("--mosaic-kernel", default="auto", choices=["auto", "swapped", "rows", "seesaw", "both"],
                  help="mosaic_sm90's kernel in the grid: auto (the op's choice, through the public op), or forced "
                       "(backend module + the op's output contract; 'both' times swapped and rows side by side, "
                       "bf16 and fp8 caches; seesaw runs bf16 caches only)")
  ap.add_argument("--out", default=None)
  ap.add_argument("--commit", default=None, help="git commit of the code (default: git rev-parse HEAD)")
  args = ap.parse_args(argv)

  dev = jax.devices()[0]
  usable = {}
  for dtype in ("bfloat16", "fp8_e4m3"):
    for name, reason in available_backends(dtype).items():
      usable.setdefault(name, []).append(reason)
  backends = [n for n, reasons in usable.items() if all(r is None for r in reasons)]
  skipped = {n: [r for r in reasons if r] for n, reasons in usable.items() if n not in backends}
  if args.backends:
    wanted = args.backends.split(",")
    missing = [w for w in wanted if w not in backends]
    if missing:
      sys.exit(f"requested backends cannot run here: {missing}; available: {backends}; why: {skipped}")
    backends = wanted
  out_path = args.out or (os.path.join(os.environ["OUT"], "mla_bench.json") if os.environ.get("OUT") else
                          os.path.join("bench", "results", f"mla_{dev.device_kind.replace(' ', '_')}.json"))
  result = dict(device=dev.device_kind, platform=dev.platform,
                compute_capability=getattr(dev, "compute_capability", None),
                sm_count=getattr(dev, "core_count", None), jax_version=jax.__version__,
                python=platform.python_version(), commit=args.commit or git_commit(), backends=backends,
                backends_not_available=skipped, time=time.strftime("%Y-%m-%d %H:%M:%S"),
                timing="median of 5 batches of back-to-back jitted calls alternating 2 input sets",
                records=[], checks=[], sweep=[])

  def save():
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with open(out_path, "w") as f:
      json.dump(result, f, indent=1)

  print(f"device {dev.device_kind} cc {result['compute_capability']} SMs {result['sm_count']} jax "
        f"{jax.__version__} commit {result['commit']} backends {backends} (not available: {skipped})", flush=True)
  result["copy_gbps"] = ceiling = copy_ceiling_gbps()
  print(f"copy ceiling {ceiling:.0f} GB/s (read + write)", flush=True)
  save()

  # what backend="auto" picks here (its INFO line goes to stderr)
  q, cache, table, lens = make_inputs(0, 2, 16, 1, 128, "fp8_e4m3", "uniform")[0]
  jax.block_until_ready(mla_decode(q, cache, table, lens, softmax_scale=0.1))
  result["auto_choice_fp8"] = [m for m in _log_records if "backend=auto" in m]
  print("auto:", result["auto_choice_fp8"], flush=True)

  if not args.no_check:
    for name in backends:
      try:
        rows = check_backend(name)
      except Exception as e:  # noqa: BLE001 - keep going: the timings below still say something
        rows = [dict(backend=name, ok=False, error=f"{type(e).__name__}: {str(e)[:2000]}")]
      for row in rows:
        result["checks"].append(row)
        print("check", json.dumps(row), flush=True)
    save()

  if args.sweep and "triton" in backends:
    for (b, h, L, dtype), configs in SWEEP:
      sets = [make_inputs(seed, b, h, 1, L, dtype, "uniform")[0] for seed in (1, 2)]
      nbytes = b * L * cache_bytes_per_token(dtype)
      for cfg in configs:
        fn = jax.jit(lambda q, c, t, s, _cfg=tuple(cfg.items()): triton_backend.mla_decode(
            q, c, t, s, softmax_scale=0.1, causal=False, **dict(_cfg)))
        try:
          sec = time_calls(fn, sets)
        except Exception as e:  # noqa: BLE001 - a config the compiler rejects is reported, not fatal
          print(f"sweep b{b} h{h} L{L} {dtype} {cfg}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
          result["sweep"].append(dict(b=b, h=h, L=L, dtype=dtype, config=cfg, error=str(e)[:1000]))
          continue
        full = {**triton_backend.default_config(b, h, L // PAGE, PAGE, interpret=False, cache_dtype=dtype), **cfg}
        print(f"sweep b{b} h{h} L{L} {dtype} {full}: {sec * 1e6:.1f} us {nbytes / sec / 1e9:.0f} GB/s", flush=True)
        result["sweep"].append(dict(b=b, h=h, L=L, dtype=dtype, config=full, us=sec * 1e6, gbps=nbytes / sec / 1e9))
      del sets
      save()

  grid = dict(QUICK if args.quick else GRID)
  if args.batches:
    grid["b"] = tuple(int(x) for x in args.batches.split(","))
  for b, h, L, sq, dtype, lengths in itertools.product(*grid.values()):
    sets, totals = zip(*[make_inputs(seed, b, h, sq, L, dtype, lengths) for seed in (1, 2)])
    total = sum(totals) / len(totals)
    for name, kernel in _grid_entries(backends, args.mosaic_kernel):
      fn = _grid_fn(name, kernel, causal=sq > 1)
      try:
        arg_sets = list(sets)
        if kernel == STEP:
          arg_sets = [(q, c, t, s, mla_decode_schedule(s, t, num_heads=h, q_len=sq, cache_dtype=dtype,
                                                       backend=name)) for q, c, t, s in arg_sets]
        sec = time_calls(fn, arg_sets)
      except Exception as e:  # noqa: BLE001 - e.g. out of memory for the xla reference: report and go on
        name = _label(name, kernel)
        print(f"{name} b{b} h{h} L{L} sq{sq} {dtype} {lengths}: FAILED {type(e).__name__}: {str(e)[:200]}",
              flush=True)
        result["records"].append(dict(backend=name, b=b, h=h, L=L, sq=sq, dtype=dtype, lengths=lengths,
                                      error=str(e)[:500]))
        continue
      nbytes = total * cache_bytes_per_token(dtype)
      if name == "mosaic_sm90":
        step = kernel == STEP
        kernel = mosaic_sm90.choose_kernel(sq * h, dtype == "fp8_e4m3", "auto" if step else kernel)
        kernel += f"+{STEP}" if step else ""
      name = _label(name, kernel)
      rec = dict(backend=name, b=b, h=h, L=L, sq=sq, dtype=dtype, lengths=lengths, sum_len=total,
                 us=sec * 1e6, gbps=nbytes / sec / 1e9, tflops=FLOPS_PER_QK_TOKEN * sq * h * total / sec / 1e12,
                 pct_copy=100 * nbytes / sec / 1e9 / ceiling)
      if name == "triton":
        rec["config"] = triton_backend.default_config(b, sq * h, L // PAGE, PAGE, interpret=False,
                                                      cache_dtype=dtype)
      result["records"].append(rec)
      print(f"{name:20s} b{b:<4d} h{h:<4d} L{L:<6d} sq{sq} {dtype:9s} {lengths:8s} {rec['us']:9.1f} us "
            f"{rec['gbps']:7.0f} GB/s {rec['tflops']:6.1f} TFLOP/s {rec['pct_copy']:5.1f}%", flush=True)
    del sets
    save()

  print(f"\nMLA decode, page {PAGE}, {dev.device_kind}, jax {jax.__version__}, commit {result['commit'][:12]}, "
        f"copy ceiling {ceiling:.0f} GB/s")
  if result["checks"]:
    bad = [c for c in result["checks"] if not c["ok"]]
    print(f"correctness: {len(result['checks']) - len(bad)}/{len(result['checks'])} checks pass"
          + "".join(f"\n  FAIL {c}" for c in bad))
  print(f"{'backend':20s} {'b':>4s} {'h':>4s} {'L':>6s} {'sq':>2s} {'cache':9s} {'lengths':8s} {'us':>9s} "
        f"{'GB/s':>7s} {'TFLOP/s':>7s} {'%copy':>6s}")
  for r in result["records"]:
    if "error" in r:
      print(f"{r['backend']:20s} {r['b']:4d} {r['h']:4d} {r['L']:6d} {r['sq']:2d} {r['dtype']:9s} "
            f"{r['lengths']:8s} FAILED")
      continue
    print(f"{r['backend']:20s} {r['b']:4d} {r['h']:4d} {r['L']:6d} {r['sq']:2d} {r['dtype']:9s} {r['lengths']:8s} "
          f"{r['us']:9.1f} {r['gbps']:7.0f} {r['tflops']:7.1f} {r['pct_copy']:6.1f}")
  result["elapsed_s"] = time.perf_counter() - t_start
  save()
  print(f"wrote {out_path} ({result['elapsed_s']:.0f} s)")


if __name__ == "__main__":
  main()
