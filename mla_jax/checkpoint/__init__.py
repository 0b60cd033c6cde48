"""Checkpoint loading (HF safetensors)."""

from mla_jax.checkpoint.hf import (ParamTarget, hf_param_map, load_hf_weights, load_model, read_tensor_index,
                                   safetensors_files)

__all__ = ["ParamTarget", "hf_param_map", "load_hf_weights", "load_model", "read_tensor_index", "safetensors_files"]
