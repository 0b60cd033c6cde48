"""One-core GPU interpret-mode runs for tests/test_gpu_interpret.py (not collected by pytest).

    python tests/gpu_interpret_worker.py run     # xla, triton, then mosaic_sm90 (interpret mode, jitted), on an
                                                 # fp8 and a bf16 cache; prints one JSON line of compare() results
    python tests/gpu_interpret_worker.py refuse  # mosaic_sm90 in interpret mode on the pool the environment gives;
                                                 # prints the error it raised as one JSON line

The process pins itself to one CPU before JAX starts, so XLA:CPU's default intra-op pool has one thread. Without
the pool that importing pallas_kernels reserves, `run` hangs every time, every thread waiting in Barrier.wait
(pallas_kernels/gpu_interpret.py says why). The case is issue 14's: B=3, H=20, Sq=2 causal, lengths 0/77/130.
"""
import json
import os
import sys

if hasattr(os, "sched_setaffinity"):
  os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import pallas_kernels  # noqa: E402
from pallas_kernels.mla_decode import api, mosaic_sm90  # noqa: E402
from pallas_kernels.mla_decode.reference import mla_decode_numpy  # noqa: E402
from pallas_kernels.testing import compare, random_problem  # noqa: E402

SCALE = 192 ** -0.5
LENS = [0, 77, 130]


def f64_reference(q, cache, table, lens):
  lat, rope = cache.dequantize()
  return mla_decode_numpy(np.asarray(q, np.float64), np.asarray(lat), np.asarray(rope), np.asarray(table),
                          np.asarray(lens), softmax_scale=SCALE, causal=True, page_size=64)


def mosaic_interpret(q, cache, table, lens):
  """The backend module and the op's output contract (the public op's custom_partitioning cannot carry interpret
  mode's ordered callbacks), jitted as scripts/check_mla_gpu.py calls it."""
  out, lse = mosaic_sm90.mla_decode(q, cache, table, lens, softmax_scale=SCALE, causal=True, interpret=True)
  return api.apply_output_contract(out, lse, cache, table, lens)


def run() -> dict:
  results = {}
  for seed, dtype in enumerate(("fp8_e4m3", "bfloat16")):
    q, cache, table, lens = random_problem(seed, lens=LENS, sq=2, heads=20, dtype=dtype)
    ref = f64_reference(q, cache, table, lens)
    for backend in ("xla", "triton"):
      got = jax.jit(lambda q, c, t, l, b=backend: pallas_kernels.mla_decode(
          q, c, t, l, softmax_scale=SCALE, causal=True, backend=b, interpret=True))(q, cache, table, lens)
      results[f"{backend} {dtype}"] = compare(*got, *ref)
    results[f"mosaic_sm90 {dtype}"] = compare(*jax.jit(mosaic_interpret)(q, cache, table, lens), *ref)
  return results


def refuse() -> dict:
  q, cache, table, lens = random_problem(0, lens=[5], sq=1, heads=16, dtype="bfloat16")
  try:
    mosaic_sm90.mla_decode(q, cache, table, lens, softmax_scale=SCALE, causal=False, interpret=True)
  except RuntimeError as e:
    return {"error": str(e)}
  return {"error": None}


if __name__ == "__main__":
  print(json.dumps({"run": run, "refuse": refuse}[sys.argv[1]]()), flush=True)
