"""Benchmark of the split-KV schedule kernel (pallas_kernels.mla_decode.split_kv.schedule_kernel) alone.

  python scripts/bench_schedule.py --out bench/results/schedule_<device>_<commit>.json [--commit SHA] [--iters 20]

The schedule is a latency-bound kernel of a few microseconds that every mla_decode call without a given schedule
pays (a decode step pays it once for all its layers). For the benchmark's batches, with the share counts of the
kernels mosaic_sm90 picks for them, this times the kernel at each warp count and the plain-XLA reference
(mosaic_sm90.schedule on the page counts: the same values from ~7 small fusions) by CUPTI, and checks that every
variant gives the reference's prefix sums and shares. Prints a table last and writes JSON (device, jax version,
commit).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.mla_decode import mosaic_sm90, split_kv
from pallas_kernels.testing import commit_id, device_time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_mla_gpu import variant_lens  # noqa: E402  (a sibling script: its timing variants' lengths)

# (name, batch, length, ragged lengths, query rows a sequence, kernel)
SHAPES = (("fp8 h16 b128 L4096", 128, 4096, False, 16, "swapped"),
          ("fp8 h16 b128 ragged[1..2L]", 128, 4096, True, 16, "swapped"),
          ("fp8 h16 b32 L16384", 32, 16384, False, 16, "swapped"),
          ("fp8 h16 b1 L4096", 1, 4096, False, 16, "swapped"),
          ("fp8 h128 b64 L4096", 64, 4096, False, 128, "seesaw"),
          ("fp8 h128 b128 L4096", 128, 4096, False, 128, "seesaw"),
          ("fp8 h16 b1100 ragged[1..2L]", 1100, 4096, True, 16, "swapped"))
WARPS = (split_kv.SCHEDULE_WARPS, 4, 2)


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--out", required=True)
  ap.add_argument("--commit", default=None)
  ap.add_argument("--iters", type=int, default=20)
  args = ap.parse_args()
  dev = jax.devices()[0]
  info = dict(device=dev.device_kind, platform=dev.platform, jax=jax.__version__, commit=commit_id(args.commit))
  rows = []
  for name, batch, length, ragged, qrows, kernel in SHAPES:
    lens = jnp.asarray(variant_lens(batch, length, ragged), jnp.int32)
    parts, cut = mosaic_sm90.schedule_shares(qrows, True, kernel)
    xla = jax.jit(lambda n, parts=parts, cut=cut: mosaic_sm90.schedule((n + mosaic_sm90.PAGE - 1) // mosaic_sm90.PAGE,
                                                                        parts, cut))
    cu_ref, sched_ref = (np.asarray(x) for x in xla(lens))
    variants = [(f"kernel {w} warps", jax.jit(lambda n, w=w, parts=parts, cut=cut: split_kv.schedule_kernel(
        n, parts, page=mosaic_sm90.PAGE, cut_pages=cut, num_warps=w))) for w in WARPS]
    for label, fn in variants + [("xla", xla)]:
      out = [np.asarray(x) for x in fn(lens)]
      same = None if label == "xla" else (np.array_equal(out[0][:batch + 1], cu_ref)       # None: the reference
                                          and np.array_equal(out[1][:, :parts].T, sched_ref))
      t = device_time(fn, lens, iters=args.iters)
      rows.append(dict(shape=name, batch=batch, num_parts=parts, cut_pages=cut, variant=label, us=t["us"],
                       method=t["method"], kernels=t.get("kernels"), same_as_xla=same))
      print(f"{name:30s} parts {parts:3d}  {label:16s} {t['us']:7.2f} us  "
            f"{'(reference)' if same is None else f'same as xla: {same}'}", flush=True)
  with open(args.out, "w") as f:
    json.dump(dict(info=info, rows=rows), f, indent=1)
  labels = [r["variant"] for r in rows if r["shape"] == SHAPES[0][0]]
  print(f"\n{info['device']}, jax {info['jax']}, commit {info['commit']}; CUPTI µs of the schedule alone")
  print(f"{'shape':30s} " + " ".join(f"{v:>16s}" for v in labels))
  for name, *_ in SHAPES:
    print(f"{name:30s} " + " ".join(f"{r['us']:16.2f}" for r in rows if r["shape"] == name))
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
