"""Paged MLA decode: cache format (cache.py), op and backend choice (api.py), XLA reference (reference.py),
portable Pallas Triton kernel (triton.py), Hopper Mosaic GPU kernel (mosaic_sm90.py)."""
from pallas_kernels.mla_decode.api import BACKENDS, available_backends, mla_decode
from pallas_kernels.mla_decode.cache import MLAKVCache, dequantize_fp8, quantize_fp8

__all__ = ["BACKENDS", "MLAKVCache", "available_backends", "dequantize_fp8", "mla_decode", "quantize_fp8"]
