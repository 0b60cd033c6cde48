"""Benchmark of the w4a16 ops (pallas_kernels.w4a16) at DeepSeek-V3 shapes, with the copy ceiling of the same run.

  python scripts/bench_w4a16.py --out bench/results/w4a16_h200.json [--commit SHA] [--quick] [--sweep]
                                [--backends triton,mosaic_sm90]

Dense AWQ linears (7168->18432, 18432->7168, 7168->24576, 16384->7168) at M = 1, 16, 64, 128, and the routed
experts of one MoE layer (E=256, D=7168, I=2048, top-8, g64 and g128) at T = 1, 16, 64, 128, 256 with uniform
random routing. For each: microseconds, the bytes that must be read (weights of the experts that got tokens,
scales and zeros included), GB/s and % of the copy ceiling. The `xla` backend (dequantize + dot) is timed as the
baseline where it finishes in reasonable time. Before timing, each kernel shape is checked against the xla
reference on the same inputs (relative error of the output). --sweep times kernel configurations on two shapes.
Prints a table last and writes JSON (device, jax version, commit). --backends times each named kernel backend on
the same inputs (rows carry `backend`); a new backend is checked against xla at every timed shape.
"""
from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.testing import commit_id, copy_ceiling_gbps, device_time, time_calls
from pallas_kernels.w4a16 import api, layout, routing


DENSE_SHAPES = ((7168, 18432), (18432, 7168), (7168, 24576), (16384, 7168))
MOE = dict(experts=256, hidden=7168, inter=2048, top_k=8)


def rel_err(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def expert_bytes(w: layout.W4A16Weight) -> int:
  return w.nbytes() // w.lead_shape[0]


def rates(nbytes: float, wall_s: float, device_us: float | None, ceiling: float) -> dict:
  """GB/s and % of the copy ceiling by back-to-back wall time (host dispatch included: a jitted call with a packed
  weight costs ~60-100 µs of host time, more than a small kernel) and by device time (what the kernel does)."""
  out = dict(gbps=nbytes / wall_s / 1e9, pct_copy=100 * nbytes / wall_s / 1e9 / ceiling)
  if device_us:
    out.update(device_gbps=nbytes / device_us / 1e3, device_pct_copy=100 * nbytes / device_us / 1e3 / ceiling)
  return out


def bench_dense(rows, ceiling, ms, quick, config=None, check=True, backend="triton", shapes=None, group=64):
  """config: the kernel config; a "block_m" key (as bench_moe takes) becomes the dense kernel's min_block_m.
  shapes: (K, N) pairs instead of DENSE_SHAPES (quick: its first two)."""
  key = jax.random.key(0)
  kernel_config = dict(config or {})
  if "block_m" in kernel_config:
    kernel_config["min_block_m"] = kernel_config.pop("block_m")
  for (k, n) in shapes or (DENSE_SHAPES[:2] if quick else DENSE_SHAPES):
    w = layout.random_weight(key, (), k, n, group)
    wb = jax.random.normal(key, (k, n), jnp.bfloat16) * 0.01
    for m in ms:
      xs = [jax.random.normal(jax.random.key(i), (m, k), jnp.bfloat16) for i in range(2)]
      f_tri = jax.jit(lambda x, w: api.w4a16_matmul(x, w, backend=backend, config=kernel_config))
      f_xla = jax.jit(lambda x, w: api.w4a16_matmul(x, w, backend="xla"))
      f_bf16 = jax.jit(lambda x, w: x @ w)
      err = rel_err(f_tri(xs[0], w), f_xla(xs[0], w)) if check else None
      t_tri = time_calls(f_tri, [(x, w) for x in xs], max_calls=500)
      t_xla = time_calls(f_xla, [(x, w) for x in xs], max_calls=500)
      t_bf16 = time_calls(f_bf16, [(x, wb) for x in xs], max_calls=500)
      dev = device_time(f_tri, xs[0], w)
      nbytes = w.nbytes() + 2 * m * (k + n)
      rows.append(dict(op="dense", backend=backend, k=k, n=n, m=m, group=group, us=t_tri * 1e6,
                       device_us=dev["us"], kernels=dev.get("kernels"), xla_us=t_xla * 1e6,
                       bf16_dot_us=t_bf16 * 1e6, bytes=nbytes, **rates(nbytes, t_tri, dev["us"], ceiling),
                       rel_err_vs_xla=err, config=config))
      print(rows[-1], flush=True)


def bench_moe(rows, ceiling, ts, groups, xla_ts, config=None, check_ts=(16,), backend="triton"):
  """config: the kernel config, plus optionally "block_m" (w4a16_moe's row block; default api.default_block_m)."""
  e, d, i, k = MOE["experts"], MOE["hidden"], MOE["inter"], MOE["top_k"]
  kernel_config = dict(config or {})
  block_m = kernel_config.pop("block_m", None)
  for g in groups:
    w13 = layout.random_weight(jax.random.key(1), (e,), d, i, g, gate_up=True)
    w2 = layout.random_weight(jax.random.key(2), (e,), i, d, g)
    per_expert = expert_bytes(w13) + expert_bytes(w2)
    for t in ts:
      sets = []
      for s in range(2):
        ids, wts = routing.uniform_random(jax.random.key(100 + s), t, e, k)
        sets.append((jax.random.normal(jax.random.key(200 + s), (t, d), jnp.bfloat16), ids, wts))
      f_tri = jax.jit(lambda x, ids, wts, w13, w2: api.w4a16_moe(x, ids, wts, w13, w2, backend=backend,
                                                                  block_m=block_m, config=kernel_config))
      err = None
      if t in check_ts:
        f_xla = jax.jit(lambda x, ids, wts, w13, w2: api.w4a16_moe(x, ids, wts, w13, w2, backend="xla"))
        err = rel_err(f_tri(*sets[0], w13, w2), f_xla(*sets[0], w13, w2))
      t_tri = time_calls(f_tri, [(*s, w13, w2) for s in sets], max_calls=500)
      # the two grouped kernels alone, routing precomputed: the rest of t_tri is routing.align and combine
      bm = block_m or api.default_block_m(t, k, e, backend)
      rts = [routing.align(s[1], s[2], e, bm) for s in sets]
      busy = min(rts[0].num_blocks, e, t * k)
      kmod = api.KERNEL_BACKENDS[backend]
      f_kern = jax.jit(lambda x, rt, w13, w2: kmod.moe(x, rt, w13, w2, busy_blocks=busy, config=kernel_config))
      t_kern = time_calls(f_kern, [(s[0], rt, w13, w2) for s, rt in zip(sets, rts)], max_calls=500)
      dev = device_time(f_tri, *sets[0], w13, w2)
      t_xla = None
      if t in xla_ts:
        f_xla = jax.jit(lambda x, ids, wts, w13, w2: api.w4a16_moe(x, ids, wts, w13, w2, backend="xla"))
        t_xla = time_calls(f_xla, [(*s, w13, w2) for s in sets], min_batch_s=0.01, batches=3, max_calls=500)
      used = float(np.mean([len(np.unique(np.asarray(s[1]))) for s in sets]))
      nbytes = used * per_expert + 2 * t * d * 2
      rows.append(dict(op="moe", backend=backend, t=t, group=g, experts_used=used, us=t_tri * 1e6, kernels_us=t_kern * 1e6,
                       device_us=dev["us"], kernels=dev.get("kernels"),
                       xla_us=None if t_xla is None else t_xla * 1e6, bytes=nbytes,
                       **rates(nbytes, t_tri, dev["us"], ceiling), floor_us=nbytes / (ceiling * 1e3), block_m=bm,
                       rel_err_vs_xla=err, config=config))
      print(rows[-1], flush=True)


def bench_routing(rows, ts):
  """The MoE's XLA-side work alone: grouping pairs by expert (routing.align) and the weighted sum (combine)."""
  e, d, k = MOE["experts"], MOE["hidden"], MOE["top_k"]
  for t in ts:
    bm = api.default_block_m(t, k, e)
    sets = [routing.uniform_random(jax.random.key(300 + s), t, e, k) for s in range(2)]
    f_align = jax.jit(lambda ids, wts: routing.align(ids, wts, e, bm))
    t_align = time_calls(f_align, sets, max_calls=500)
    rts = [f_align(*s) for s in sets]
    ys = [jax.random.normal(jax.random.key(s), (rt.num_blocks * bm, d), jnp.float32) for s, rt in enumerate(rts)]
    f_comb = jax.jit(routing.combine)
    t_comb = time_calls(f_comb, list(zip(ys, rts)), max_calls=500)
    rows.append(dict(op="routing", t=t, block_m=bm, align_us=t_align * 1e6, combine_us=t_comb * 1e6))
    print(rows[-1], flush=True)


def check_exact_small(rows, backends=("triton",), probe_dir=None):
  """Float64 NumPy reference on a small odd shape, on each GPU kernel (catches layout/decode errors). A backend
  that fails it also gets a decode probe: x = identity, scales 1, zeros 0, so its output is the weight matrix the
  kernel decoded; q and that matrix go to probe_dir/w4a16_probe_<backend>.npz for reading offline."""
  rng = np.random.default_rng(0)
  k, n, g, m = 256, 200, 64, 7
  q, z = rng.integers(0, 16, (k, n)), rng.integers(0, 16, (k // g, n))
  s = (rng.uniform(0.5, 1.5, (k // g, n)) / 60).astype(np.float16)
  w = jax.tree.map(jnp.asarray, layout.pack(q, z, s, g, xp=np))
  x = rng.standard_normal((m, k)).astype(np.float32)
  xb = jnp.asarray(x, jnp.bfloat16)
  wd = (q - np.repeat(z, g, 0)) * np.repeat(s.astype(np.float64), g, 0)
  ref = np.asarray(xb, np.float64) @ wd
  variants = [(b, dict(decode=d)) for b in backends if b == "triton" for d in ("ptx", "jnp")]
  variants += [(b, None) for b in backends if b != "triton"]
  for backend, cfg in variants:
    row = dict(op="check_f64", backend=backend, decode=(cfg or {}).get("decode", "-"), m=m, k=k, n=n)
    try:
      y = api.w4a16_matmul(xb, w, backend=backend, config=cfg)
      err = float(np.abs(np.asarray(y, np.float64) - ref).max() / np.abs(ref).max())
      row.update(max_err_rel_to_max=err, ok=err < 8e-3)
    except Exception as e:  # noqa: BLE001 - a kernel that does not build is a result to record
      row.update(max_err_rel_to_max=None, ok=False, error=f"{type(e).__name__}: {str(e)[-3000:]}")
    if not row["ok"] and probe_dir and "error" not in row:
      eye = jnp.eye(k, dtype=jnp.bfloat16)
      ones = np.ones((k // g, n), np.float16)
      w1 = jax.tree.map(jnp.asarray, layout.pack(q, np.zeros_like(z), ones, g, xp=np))
      decoded = np.asarray(api.w4a16_matmul(eye, w1, backend=backend, config=cfg), np.float32)
      os.makedirs(probe_dir, exist_ok=True)
      path = os.path.join(probe_dir, f"w4a16_probe_{backend}.npz")
      np.savez(path, q=q, decoded=decoded)
      row.update(probe=path, probe_match=float(np.mean(decoded == q)))
    rows.append(row)
    print(row, flush=True)
  return {r["backend"] for r in rows if r["op"] == "check_f64" and "error" in r}


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", default="bench/results/w4a16.json")
  ap.add_argument("--commit", default=None)
  ap.add_argument("--quick", action="store_true", help="fewer shapes")
  ap.add_argument("--sweep", action="store_true", help="time kernel configurations first")
  ap.add_argument("--sweep-configs", default=None,
                  help='JSON list of kernel configs for --sweep (default: a fixed list), e.g. \'[{}, {"num_warps": 4}]\'')
  ap.add_argument("--sweep-ts", default="64", help="MoE token counts for --sweep ('' for none)")
  ap.add_argument("--sweep-ms", default="16", help="dense row counts for --sweep ('' for none)")
  ap.add_argument("--sweep-groups", default="64", help="MoE quantization group sizes for --sweep")
  ap.add_argument("--sweep-backend", default="triton", help="the kernel backend --sweep configures")
  ap.add_argument("--sweep-dense-shapes", default=None,
                  help="dense KxN shapes for --sweep, e.g. 7168x576,1536x24576 (default: DENSE_SHAPES' first two)")
  ap.add_argument("--sweep-dense-group", type=int, default=64, help="quantization group size of --sweep's dense rows")
  ap.add_argument("--backends", default="triton",
                  help="comma-separated kernel backends to time, e.g. triton,mosaic_sm90 (mosaic_sm90: Hopper only)")
  ap.add_argument("--ops", nargs="*", default=["moe", "dense"], choices=["moe", "dense", "routing"])
  args = ap.parse_args(argv)
  backends = [b for b in args.backends.split(",") if b]
  unknown = [b for b in backends if b not in api.KERNEL_BACKENDS]
  if unknown:
    raise SystemExit(f"--backends: unknown {unknown}; choose from {sorted(api.KERNEL_BACKENDS)}")
  commit = commit_id(args.commit)
  dev = jax.devices()[0]
  result = dict(device=dev.device_kind, jax=jax.__version__, commit=commit, rows=[])
  rows = result["rows"]

  def save():
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
      json.dump(result, f, indent=1)

  ceiling = copy_ceiling_gbps()
  result["copy_gbps"] = ceiling
  print(f"copy ceiling {ceiling:.0f} GB/s", flush=True)
  checked = sorted(set(backends) | ({args.sweep_backend} if args.sweep else set()))
  broken = check_exact_small(rows, checked, probe_dir=os.path.dirname(os.path.abspath(args.out)))
  save()
  if args.sweep:
    configs = (json.loads(args.sweep_configs) if args.sweep_configs else
               [dict(), dict(num_warps=2), dict(num_warps=8), dict(block_n=256), dict(block_n=256, num_warps=8),
                dict(block_n=64, num_warps=8), dict(num_stages=1), dict(block_n=256, num_warps=2)])
    sweep_ts = tuple(int(t) for t in args.sweep_ts.split(",") if t)
    for cfg in configs:
      if args.sweep_backend in broken:
        break
      sweep_rows = []
      try:
        if sweep_ts:
          bench_moe(sweep_rows, ceiling, sweep_ts, tuple(int(g) for g in args.sweep_groups.split(",")), (),
                    config=cfg, check_ts=sweep_ts[:1], backend=args.sweep_backend)
        sweep_ms = tuple(int(m) for m in args.sweep_ms.split(",") if m)
        if sweep_ms:
          shapes = ([tuple(int(v) for v in kn.split("x")) for kn in args.sweep_dense_shapes.split(",")]
                    if args.sweep_dense_shapes else None)
          bench_dense(sweep_rows, ceiling, sweep_ms, True, config=cfg, backend=args.sweep_backend, shapes=shapes,
                      group=args.sweep_dense_group)
      except Exception as e:  # noqa: BLE001 - a config that does not build is a result
        sweep_rows.append(dict(op="error", backend=args.sweep_backend, config=cfg,
                               error=f"{type(e).__name__}: {str(e)[-3000:]}"))
        print(sweep_rows[-1], flush=True)
      for r in sweep_rows:
        r["sweep"] = True
      rows.extend(sweep_rows)
      save()
  for backend in backends:
    if backend in broken:
      print(f"skipping {backend}: it did not build (check_f64 row)", flush=True)
      continue
    try:
      if "moe" in args.ops:
        moe_ts = (1, 16, 64) if args.quick else (1, 16, 64, 128, 256)
        bench_moe(rows, ceiling, moe_ts, (64,) if args.quick else (64, 128),
                  xla_ts=(1, 64) if backend == backends[0] else (),
                  check_ts=(16,) if backend == "triton" else moe_ts, backend=backend)
        save()
      if "dense" in args.ops:
        bench_dense(rows, ceiling, (1, 16, 64, 128), args.quick, backend=backend)
        save()
    except Exception as e:  # noqa: BLE001 - record it and go on to the next backend
      rows.append(dict(op="error", backend=backend, error=f"{type(e).__name__}: {str(e)[-3000:]}"))
      print(rows[-1], flush=True)
      save()
  if "routing" in args.ops:
    bench_routing(rows, (1, 16, 64, 256))
  save()

  print(f"\n{dev.device_kind}, jax {jax.__version__}, commit {commit}, copy {ceiling:.0f} GB/s")
  print("us: wall clock per call, back to back (host dispatch included); dev us: CUPTI sum of the call's kernels "
        "(without CUPTI: wall clock); dev %copy: bytes / dev us against the copy ceiling; kern us: the MoE's two "
        "grouped kernels alone (wall clock)")
  print(f"{'op':6} {'shape':>22} {'us':>9} {'dev us':>8} {'xla us':>9} {'GB/s':>7} {'%copy':>6} {'dev %copy':>9} "
        f"{'err':>8} {'kern us':>8}")
  for r in rows:
    if r["op"] == "check_f64":
      err = "did not build" if r.get("error") else f"max err {r['max_err_rel_to_max']:.2e}"
      probe = f" probe match {r['probe_match']:.3f}" if "probe_match" in r else ""
      print(f"check  {r['backend']:12} decode={r['decode']:4} {err} ok={r['ok']}{probe}")
      continue
    if r["op"] == "error":
      print(f"error  {r['backend']}: {r['error'][:200]}")
      continue
    if r["op"] == "routing":
      print(f"routing T{r['t']} block_m {r['block_m']}: align {r['align_us']:.1f} us, combine {r['combine_us']:.1f} us")
      continue
    shape = (f"T{r['t']} g{r['group']} E{r['experts_used']:.0f}" if r["op"] == "moe"
             else f"{r['k']}x{r['n']} M{r['m']}")
    tag = " sweep " + json.dumps(r["config"]) if r.get("sweep") else ""
    tag = (f" [{r['backend']}]" if r.get("backend", "triton") != "triton" else "") + tag
    xla = f"{r['xla_us']:9.1f}" if r.get("xla_us") else f"{'-':>9}"
    err = f"{r['rel_err_vs_xla']:.1e}" if r.get("rel_err_vs_xla") is not None else "-"
    kern = f"{r['kernels_us']:8.1f}" if r.get("kernels_us") else f"{'-':>8}"
    dev = f"{r['device_us']:8.1f}" if r.get("device_us") else f"{'-':>8}"
    dev_pct = f"{r['device_pct_copy']:9.1f}" if r.get("device_pct_copy") else f"{'-':>9}"
    print(f"{r['op']:6} {shape:>22} {r['us']:9.1f} {dev} {xla} {r['gbps']:7.0f} {r['pct_copy']:6.1f} {dev_pct} "
          f"{err:>8} {kern}{tag}")
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
