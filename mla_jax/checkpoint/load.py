"""`load_model`: a checkpoint directory -> (model, config) on one device, whichever format the directory holds
(a Hugging Face safetensors checkpoint, or one written by scripts/convert.py)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx

from mla_jax.checkpoint.converted import is_converted, load_converted
from mla_jax.checkpoint.hf import load_hf_weights, resolve_dtype
from mla_jax.config import ModelConfig
from mla_jax.model.transformer import DeepseekV3


def load_model(path: str | os.PathLike, dtype: Any = "float32", *,
               put: Callable[[tuple, np.ndarray], jax.Array] | None = None):
    """HF directory (config.json + *.safetensors), or a converted one -> (DeepseekV3 model, ModelConfig).

    The model is built abstractly (`nnx.eval_shape`, no memory) and filled tensor by tensor; put(param_path,
    host_array) places each parameter (default: on the default device)."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path} is not a directory; expected an HF model directory with config.json")
    if is_converted(path):
        return load_converted(path, dtype, put=put)
    cfg = ModelConfig.from_pretrained(path)
    jdtype = resolve_dtype(dtype)
    model = nnx.eval_shape(lambda: DeepseekV3(cfg, dtype=jdtype, rngs=nnx.Rngs(0)))
    load_hf_weights(model, cfg, path, put=put)
    return model, cfg
