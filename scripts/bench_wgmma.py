"""Time wgmma steps alone (pallas_kernels.w4a16.wgmma_probe): the tensor core's ceiling for the W4A16 kernel.

  python scripts/bench_wgmma.py --out bench/results/wgmma_steps_h200.json [--commit SHA]

For each variant (N, k per call, warpgroups per CTA, A from registers or SMEM, or rebuilt per chunk by the
consumers' decode and fold): device microseconds, nanoseconds
per m64nNk16 step per SM, and the int4 weight stream that rate would carry if each step consumed 1,024 weights
(0.5 byte each, as mosaic_sm90 does): the tensor-core ceiling to set against the copy ceiling. Prints a table
last and writes JSON (device, jax version, commit).
"""
from __future__ import annotations

import argparse
import json
import os

import jax

from pallas_kernels.testing import commit_id, copy_ceiling_gbps, device_time
from pallas_kernels.w4a16 import wgmma_probe

# name -> probe arguments; the kernel's decode-size shape is N = 8, k = 32 (or 64) per call, 2 warpgroups, A regs
VARIANTS = {
    "n8 k32 wg2 regA": dict(n=8, k_per_call=32, warpgroups=2, a_in_registers=True),
    "n8 k64 wg2 regA": dict(n=8, k_per_call=64, warpgroups=2, a_in_registers=True),
    "n8 k128 wg2 regA": dict(n=8, k_per_call=128, warpgroups=2, a_in_registers=True),
    "n8 k32 wg1 regA": dict(n=8, k_per_call=32, warpgroups=1, a_in_registers=True),
    "n8 k32 wg3 regA": dict(n=8, k_per_call=32, warpgroups=3, a_in_registers=True),
    "n8 k32 wg4 regA": dict(n=8, k_per_call=32, warpgroups=4, a_in_registers=True),
    "n8 k32 wg2 smemA": dict(n=8, k_per_call=32, warpgroups=2, a_in_registers=False),
    "n16 k32 wg2 regA": dict(n=16, k_per_call=32, warpgroups=2, a_in_registers=True),
    "n32 k32 wg2 regA": dict(n=32, k_per_call=32, warpgroups=2, a_in_registers=True),
    "n64 k32 wg2 regA": dict(n=64, k_per_call=32, warpgroups=2, a_in_registers=True),
    "n128 k32 wg2 regA": dict(n=128, k_per_call=32, warpgroups=2, a_in_registers=True),
    # A built per chunk as the kernel's consumers do (word loads, decode, fma fold), 1-4 warpgroups
    **{f"n8 k64 wg{w} decode": dict(n=8, k_per_call=64, warpgroups=w, a_in_registers=True, decode=True)
       for w in (1, 2, 3, 4)},
}


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", default="bench/results/wgmma_steps.json")
  ap.add_argument("--commit", default=None)
  ap.add_argument("--iters", type=int, default=2000, help="loop iterations per warpgroup")
  ap.add_argument("--variants", default=None, help="comma-separated names (default: all)")
  args = ap.parse_args(argv)
  commit = commit_id(args.commit)
  dev = jax.devices()[0]
  sms = getattr(dev, "core_count", None) or 132
  ceiling = copy_ceiling_gbps()
  result = dict(device=dev.device_kind, jax=jax.__version__, commit=commit, sms=sms, copy_gbps=ceiling, rows=[])
  names = args.variants.split(",") if args.variants else list(VARIANTS)
  for name in names:
    v = dict(VARIANTS[name], iters=args.iters, num_ctas=sms)
    calls = wgmma_probe.B_COLS // v["k_per_call"]     # one 256-row chunk per iteration, as the kernel
    row = dict(name=name, **v, calls=calls)
    try:
      t = device_time(wgmma_probe.wgmma_steps(calls=calls, **v))
      steps_per_sm = wgmma_probe.k16_steps(calls=calls, **v) / sms
      ns_step = t["us"] * 1e3 / steps_per_sm
      row.update(us=t["us"], method=t["method"], ns_per_k16_step_per_sm=ns_step,
                 int4_gbps_equiv=sms * 1024 * 0.5 / ns_step)
    except Exception as e:  # noqa: BLE001 - a variant that does not build is a result
      row["error"] = f"{type(e).__name__}: {str(e)[-1500:]}"
    result["rows"].append(row)
    print(row, flush=True)
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(result, f, indent=1)
  print(f"\n{dev.device_kind}, jax {jax.__version__}, commit {commit}, {sms} SMs, copy {ceiling:.0f} GB/s")
  print(f"{'variant':20} {'us':>9} {'ns/step/SM':>11} {'int4 GB/s':>10} {'% copy':>7}")
  for r in result["rows"]:
    if "error" in r:
      print(f"{r['name']:20} error: {r['error'][:80]}")
      continue
    print(f"{r['name']:20} {r['us']:9.1f} {r['ns_per_k16_step_per_sm']:11.2f} {r['int4_gbps_equiv']:10.0f} "
          f"{100 * r['int4_gbps_equiv'] / ceiling:7.1f}")


if __name__ == "__main__":
  main()
