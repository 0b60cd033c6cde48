"""Pallas kernel library for mla_jax. Imports jax only, never mla_jax.

`pallas_kernels.mla_decode` is the op (DESIGN §3), so it shadows the subpackage of the same name as an attribute:
import its modules with `from pallas_kernels.mla_decode import api, cache, reference, triton`, not with
`import pallas_kernels.mla_decode.triton as ...`.
"""
from pallas_kernels.mla_decode import MLAKVCache, available_backends, mla_decode

__all__ = ["MLAKVCache", "available_backends", "mla_decode"]
