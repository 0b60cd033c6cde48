"""Pallas kernel library for mla_jax. Imports jax only, never mla_jax.

Ops: `mla_decode` (paged MLA decode over an MLAKVCache) and `w4a16_matmul` / `w4a16_moe` (AWQ int4 weights x bf16
activations; weights in `pallas_kernels.w4a16.W4A16Weight`, built with `w4a16.pack` / `w4a16.pack_gate_up`).

`pallas_kernels.mla_decode` is the op (docs/architecture.md §8), so it shadows the subpackage of the same name as
an attribute: import its modules with `from pallas_kernels.mla_decode import api, cache, reference, triton`, not
with `import pallas_kernels.mla_decode.triton as ...`.

Importing this package sets PJRT_NPROC (if unset) so that JAX's CPU client gets at least 8 threads: Pallas Mosaic
GPU interpret mode deadlocks on fewer (`pallas_kernels.gpu_interpret`). Import it before the first JAX computation.
"""
from pallas_kernels import gpu_interpret

# Before JAX creates its CPU client: enough XLA:CPU threads that Mosaic GPU interpret mode cannot deadlock
# (gpu_interpret.py says why). Only raises the pool on machines with fewer than 8 usable cores.
gpu_interpret.reserve_cpu_threads()

from pallas_kernels import w4a16
from pallas_kernels.mla_decode import (CACHE_DTYPES, MLAKVCache, SplitKVSchedule, available_backends, mla_decode,
                                      mla_decode_schedule, resolve_backend)
from pallas_kernels.w4a16 import w4a16_matmul, w4a16_moe

__all__ = ["CACHE_DTYPES", "MLAKVCache", "SplitKVSchedule", "available_backends", "mla_decode",
           "mla_decode_schedule", "resolve_backend", "w4a16", "w4a16_matmul", "w4a16_moe"]
