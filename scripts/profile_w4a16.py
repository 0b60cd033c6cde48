"""Runs the w4a16 kernels at DeepSeek-V3 shapes a few times each, for a profiler (ncu) to attach to.

  ncu --clock-control none -k regex:w4a16 --launch-count 6 python scripts/profile_w4a16.py
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.w4a16 import api
from pallas_kernels.w4a16.layout import random_weight
from pallas_kernels.w4a16.routing import uniform_random as random_routing


def main():
  w = random_weight(jax.random.key(0), (), 18432, 7168, 64)
  x = jax.random.normal(jax.random.key(1), (16, 18432), jnp.bfloat16)
  dense = jax.jit(lambda x, w: api.w4a16_matmul(x, w, backend="triton"))
  w13 = random_weight(jax.random.key(2), (256,), 7168, 2048, 64, gate_up=True)
  w2 = random_weight(jax.random.key(3), (256,), 2048, 7168, 64)
  ids, wts = random_routing(jax.random.key(4), 64, 256, 8)
  xm = jax.random.normal(jax.random.key(5), (64, 7168), jnp.bfloat16)
  moe = jax.jit(lambda *a: api.w4a16_moe(*a, backend="triton"))
  for _ in range(3):
    jax.block_until_ready(dense(x, w))
    jax.block_until_ready(moe(xm, ids, wts, w13, w2))


if __name__ == "__main__":
  main()
