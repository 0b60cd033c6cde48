"""Runs the w4a16 kernels at DeepSeek-V3 shapes, for a profiler (ncu) to attach to.

Each op is called once to compile and warm up, then once inside a CUDA profiler range, so
`ncu --profile-from-start off` sees only the second calls:

  ncu --clock-control none --profile-from-start off --section SpeedOfLight --section WarpStateStats \
      python scripts/profile_w4a16.py --backend mosaic_sm90
"""
from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import site

import jax
import jax.numpy as jnp

from pallas_kernels.w4a16 import api
from pallas_kernels.w4a16.layout import random_weight
from pallas_kernels.w4a16.routing import uniform_random as random_routing


def _cuda_profiler(start: bool):
  """cudaProfilerStart/Stop through the CUDA runtime, if one is loadable (else ncu profiles nothing)."""
  found = [f for d in site.getsitepackages() for f in glob.glob(os.path.join(d, "nvidia", "*", "lib", "libcudart.so*"))]
  for name in ("libcudart.so", "libcudart.so.13", "libcudart.so.12", *found):
    try:
      lib = ctypes.CDLL(name)
    except OSError:
      continue
    (lib.cudaProfilerStart if start else lib.cudaProfilerStop)()
    return True
  return False


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--backend", default="mosaic_sm90")
  ap.add_argument("--moe-ts", default="1,64", help="MoE token counts")
  ap.add_argument("--dense-ms", default="16", help="dense (18432 -> 7168) row counts")
  ap.add_argument("--group", type=int, default=64)
  ap.add_argument("--config", default="{}", help="kernel config (JSON), e.g. '{\"ablate\": \"load_only\"}'")
  args = ap.parse_args()
  config = json.loads(args.config)
  g = args.group
  w = random_weight(jax.random.key(0), (), 18432, 7168, g)
  w13 = random_weight(jax.random.key(2), (256,), 7168, 2048, g, gate_up=True)
  w2 = random_weight(jax.random.key(3), (256,), 2048, 7168, g)
  dense = jax.jit(lambda x, w: api.w4a16_matmul(x, w, backend=args.backend, config=config))
  moe = jax.jit(lambda *a: api.w4a16_moe(*a, backend=args.backend, config=config))
  calls = []
  for m in (int(s) for s in args.dense_ms.split(",") if s):
    calls.append((dense, (jax.random.normal(jax.random.key(1), (m, 18432), jnp.bfloat16), w)))
  for t in (int(s) for s in args.moe_ts.split(",") if s):
    ids, wts = random_routing(jax.random.key(4), t, 256, 8)
    calls.append((moe, (jax.random.normal(jax.random.key(5), (t, 7168), jnp.bfloat16), ids, wts, w13, w2)))
  for fn, a in calls:                                  # compile and warm up outside the profiled range
    jax.block_until_ready(fn(*a))
  if not _cuda_profiler(True):
    print("profile_w4a16: no CUDA runtime library found; the profiled range is not marked")
  for fn, a in calls:
    jax.block_until_ready(fn(*a))
  _cuda_profiler(False)


if __name__ == "__main__":
  main()
