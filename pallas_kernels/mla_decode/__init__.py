"""Paged MLA decode: cache format (cache.py), op and backend choice (api.py), XLA reference (reference.py),
portable Pallas Triton kernel (triton.py), Hopper Mosaic GPU kernel (mosaic_sm90.py)."""
from pallas_kernels.mla_decode.api import (BACKENDS, SplitKVSchedule, available_backends, mla_decode,
                                          mla_decode_schedule, resolve_backend)
from pallas_kernels.mla_decode.cache import CACHE_DTYPES, MLAKVCache, dequantize_fp8, quantize_fp8

__all__ = ["BACKENDS", "CACHE_DTYPES", "MLAKVCache", "SplitKVSchedule", "available_backends", "dequantize_fp8",
           "mla_decode", "mla_decode_schedule", "quantize_fp8", "resolve_backend"]
