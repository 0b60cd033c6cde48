"""Pallas kernel library for mla_jax. Imports jax only, never mla_jax."""
from pallas_kernels.mla_decode import MLAKVCache, available_backends, mla_decode

__all__ = ["MLAKVCache", "available_backends", "mla_decode"]
