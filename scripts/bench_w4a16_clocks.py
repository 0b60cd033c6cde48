"""SM clock, power and throttle reasons while the w4a16 MoE runs back to back, per kernel config.

  python scripts/bench_w4a16_clocks.py --configs '[{}, {"ablate": "load_only"}, {"ablate": "compute_only"}]' \
      [--t 64] [--group 128] [--seconds 2] [--out F.json] [--commit SHA]

A kernel that is co-limited by its memory stream and its instruction issue may also be slowed by the clock the GPU
can hold at the power both draw together. For each config (and for a plain copy and a plain read of 2 GiB, the
memory-only reference) the op runs back to back for --seconds while `nvidia-smi` samples the SM clock, the power
draw and the active clock-event reasons every 50 ms. Prints a table last and writes JSON. Timing ablations give
wrong outputs (mosaic_sm90.ABLATIONS); nothing here checks values.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import threading
import time

import jax
import jax.numpy as jnp

from pallas_kernels.testing import commit_id
from pallas_kernels.w4a16 import api, layout, routing

FIELDS = ("clocks.sm", "clocks.mem", "power.draw", "temperature.gpu", "clocks_event_reasons.active")
# nvidia-smi's clock-event reason bits (nvml.h, nvmlClocksEventReason*)
REASONS = {0x1: "idle", 0x2: "app_clock", 0x4: "sw_power_cap", 0x8: "hw_slowdown", 0x10: "sync_boost",
           0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake", 0x100: "display_clock"}


class Sampler:
  """nvidia-smi --query-gpu in a background process, one CSV line per period."""

  def __init__(self, period_ms: int = 50):
    self.cmd = ["nvidia-smi", f"--query-gpu={','.join(FIELDS)}", "--format=csv,noheader,nounits",
                f"-lms={period_ms}", "-i", "0"]
    self.lines: list[str] = []

  def __enter__(self):
    self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    self.thread = threading.Thread(target=lambda: self.lines.extend(iter(self.proc.stdout.readline, "")),
                                   daemon=True)
    self.thread.start()
    return self

  def __exit__(self, *exc):
    self.proc.terminate()
    self.proc.wait(timeout=10)
    self.thread.join(timeout=10)

  def summary(self) -> dict:
    rows = []
    for line in self.lines:
      parts = [p.strip() for p in line.split(",")]
      if len(parts) != len(FIELDS):
        continue
      try:
        rows.append((float(parts[0]), float(parts[1]), float(parts[2]), float(parts[3]), int(parts[4], 16)))
      except ValueError:
        continue
    if not rows:
      return dict(samples=0, raw=self.lines[:5])
    rows = rows[len(rows) // 5:]            # the first fifth: the clocks and power still settling
    reasons = {}
    for r in rows:
      for bit, name in REASONS.items():
        if r[4] & bit:
          reasons[name] = reasons.get(name, 0) + 1
    return dict(samples=len(rows), series=[r[:3] for r in rows], sm_mhz=statistics.median(r[0] for r in rows),
                sm_mhz_min=min(r[0] for r in rows), mem_mhz=statistics.median(r[1] for r in rows),
                power_w=statistics.median(r[2] for r in rows), power_w_max=max(r[2] for r in rows),
                temp_c=max(r[3] for r in rows),
                reasons={k: round(v / len(rows), 2) for k, v in sorted(reasons.items())})


def run_for(fn, args_list, seconds: float) -> float:
  """Calls fn back to back (cycling through args_list) for about `seconds`; seconds per call. Compile and warm
  up (fn once per argument set) before this, outside the sampled window."""
  calls, t0 = 0, time.perf_counter()
  while time.perf_counter() - t0 < seconds:
    out = None
    for i in range(10):
      out = fn(*args_list[(calls + i) % len(args_list)])
    calls += 10
    jax.block_until_ready(out)
  return (time.perf_counter() - t0) / calls


def warm_up(fn, args_list):
  for a in args_list:
    jax.block_until_ready(fn(*a))


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--configs", default='[{}, {"ablate": "load_only"}, {"ablate": "compute_only"}]')
  ap.add_argument("--t", type=int, default=64)
  ap.add_argument("--group", type=int, default=128)
  ap.add_argument("--seconds", type=float, default=2.0)
  ap.add_argument("--backend", default="mosaic_sm90")
  ap.add_argument("--out", default="bench/results/w4a16_clocks.json")
  ap.add_argument("--commit", default=None)
  args = ap.parse_args(argv)
  if shutil.which("nvidia-smi") is None:
    raise SystemExit("bench_w4a16_clocks: needs nvidia-smi on PATH (an NVIDIA GPU machine); none found.")
  e, d, i, k = 256, 7168, 2048, 8
  dev = jax.devices()[0]
  result = dict(device=dev.device_kind, jax=jax.__version__, commit=commit_id(args.commit), t=args.t,
                group=args.group, rows=[])

  nbytes = 2 << 30
  bufs = [jnp.full((nbytes // 4,), v, jnp.int32) for v in range(2)]
  refs = [("copy 2 GiB (x + 1)", jax.jit(lambda x: x + 1), 2 * nbytes),
          ("read 2 GiB (max)", jax.jit(lambda x: jnp.max(x)), nbytes)]
  for name, fn, moved in refs:
    warm_up(fn, [(b,) for b in bufs])
    with Sampler() as s:
      per_call = run_for(fn, [(b,) for b in bufs], args.seconds)
    result["rows"].append(dict(what=name, us=per_call * 1e6, gbps=moved / per_call / 1e9, **s.summary()))
    print(result["rows"][-1], flush=True)
  del bufs

  w13 = layout.random_weight(jax.random.key(1), (e,), d, i, args.group, gate_up=True)
  w2 = layout.random_weight(jax.random.key(2), (e,), i, d, args.group)
  sets = []
  for n in range(2):
    ids, wts = routing.uniform_random(jax.random.key(100 + n), args.t, e, k)
    sets.append((jax.random.normal(jax.random.key(200 + n), (args.t, d), jnp.bfloat16), ids, wts, w13, w2))
  for cfg in json.loads(args.configs):
    fn = jax.jit(lambda x, ids, wts, a, b, cfg=cfg: api.w4a16_moe(x, ids, wts, a, b, backend=args.backend,
                                                                  config=cfg))
    warm_up(fn, sets)
    with Sampler() as s:
      per_call = run_for(fn, sets, args.seconds)
    result["rows"].append(dict(what=f"moe T{args.t} g{args.group} {json.dumps(cfg)}", config=cfg,
                               us=per_call * 1e6, **s.summary()))
    print(result["rows"][-1], flush=True)

  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(result, f, indent=1)
  print(f"\n{dev.device_kind}, jax {jax.__version__}, commit {result['commit']}; medians over the run, first fifth "
        "dropped; reasons: share of samples")
  print(f"{'what':58} {'us':>9} {'GB/s':>6} {'SM MHz':>7} {'min':>5} {'W':>5} {'W max':>5} {'C':>3}  reasons")
  for r in result["rows"]:
    gbps = f"{r['gbps']:6.0f}" if "gbps" in r else " " * 6
    if not r.get("samples"):
      print(f"{r['what'][:58]:58} {r['us']:9.1f} {gbps} no samples: {r.get('raw')}")
      continue
    print(f"{r['what'][:58]:58} {r['us']:9.1f} {gbps} {r['sm_mhz']:7.0f} {r['sm_mhz_min']:5.0f} {r['power_w']:5.0f} "
          f"{r['power_w_max']:5.0f} {r['temp_c']:3.0f}  {r['reasons']}")
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
