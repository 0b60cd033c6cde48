"""Runs one small w4a16 mosaic_sm90 matmul with a kernel config given as JSON, checks it against the xla path and
prints the time; a driver runs each config in its own process under a timeout (a deadlocked kernel never returns).

  python scripts/debug_w4a16_hang.py '{"plane_split": 2}' [M K N G]
"""
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.w4a16 import api, layout


def main(argv):
  cfg = json.loads(argv[0])
  m, k, n, g = (int(v) for v in (argv[1:5] if len(argv) >= 5 else (16, 1024, 512, 128)))
  w = layout.random_weight(jax.random.key(0), (), k, n, g)
  x = jax.random.normal(jax.random.key(1), (m, k), jnp.bfloat16)
  f = jax.jit(lambda x, w: api.w4a16_matmul(x, w, backend="mosaic_sm90", config=cfg))
  t = time.perf_counter()
  y = np.asarray(f(x, w), np.float32)
  ref = np.asarray(api.w4a16_matmul(x, w, backend="xla"), np.float32)
  err = float(np.abs(y - ref).max() / np.abs(ref).max())
  print(json.dumps(dict(config=cfg, shape=[m, k, n, g], first_call_s=round(time.perf_counter() - t, 2),
                        rel_err=err)), flush=True)


if __name__ == "__main__":
  main(sys.argv[1:])
