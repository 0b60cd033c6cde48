"""Run one check_mla_gpu.py timing variant a few times, for a profiler (Nsight Compute) to pick a launch from.

  ncu --clock-control none --kernel-name body_mosaic_gpu_kernel --launch-skip 1 --launch-count 1 --set full \
      -o /tmp/rows_fp8 python scripts/ncu_mla.py --variant "fp8_e4m3 h128 rows"

The first call compiles and warms up; skip it with --launch-skip. Prints the variant's problem and nothing else:
the profiler's report is the output. "l2 resident" variants read their pages from one L2-sized pool, as in
check_mla_gpu.py (l2_resident_table): their profile is the kernel's on-chip bound.
"""
from __future__ import annotations

import argparse
import os
import sys

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_mla_gpu import SCALE, timing_variants, variant_lens, variant_table  # noqa: E402  (a sibling script)

from pallas_kernels.mla_decode import mosaic_sm90  # noqa: E402
from pallas_kernels.testing import random_problem  # noqa: E402


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--variant", required=True, help="an exact variant name of check_mla_gpu.py --timing")
  ap.add_argument("--calls", type=int, default=2)
  args = ap.parse_args()
  found = [v for v in timing_variants() if v[0] == args.variant]
  if not found:
    sys.exit(f"unknown variant {args.variant!r}; known: {', '.join(v[0] for v in timing_variants())}")
  name, dtype, heads, sq, batch, length, ragged, backend, kw = found[0]
  if backend != "mosaic_sm90":
    sys.exit(f"{name!r} does not run mosaic_sm90")
  lens = variant_lens(batch, length, ragged)
  q, cache, table, lens_a = random_problem(11, lens=lens, sq=sq, heads=heads, dtype=dtype, extra_pages=8)
  kw, table = variant_table(kw, table, lens)
  fn = jax.jit(lambda q, c, t, l: mosaic_sm90.mla_decode(q, c, t, l, softmax_scale=SCALE, causal=False, **kw))
  print(f"{name}: dtype {dtype} heads {heads} sq {sq} batch {batch} L {length} ragged {ragged} kwargs {kw}")
  for _ in range(args.calls):
    jax.block_until_ready(fn(q, cache, table, lens_a))


if __name__ == "__main__":
  main()
