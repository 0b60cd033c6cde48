"""`load_model`: a checkpoint directory -> (model, config) on one device, whichever format the directory holds
(a Hugging Face safetensors checkpoint, or one written by scripts/convert.py)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mla_jax.checkpoint.converted import MANIFEST, is_converted, load_converted
from mla_jax.checkpoint.errors import read_json
from mla_jax.checkpoint.files import load_progress, resolve_model_dir
from mla_jax.checkpoint.hf import load_hf_weights, resolve_dtype
from mla_jax.config import ModelConfig
from mla_jax.model.transformer import DeepseekV3


def load_model(path: str | os.PathLike, dtype: Any = "float32", *,
               put: Callable[[tuple, np.ndarray], jax.Array] | None = None):
    """HF directory (config.json + *.safetensors), or a converted one -> (DeepseekV3 model, ModelConfig).

    The model is built abstractly (`nnx.eval_shape`, no memory) and filled tensor by tensor; put(param_path,
    host_array) places each parameter (default: on the default device)."""
    path = resolve_model_dir(path)         # a path, or the name of an embedded model
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path} is not a directory; expected an HF model directory with config.json")
    if is_converted(path):
        total = len(read_json(os.path.join(path, MANIFEST), "manifest.json").get("tensors") or ())
        with load_progress(path, total) as bar:
            return load_converted(path, dtype, put=_counted(put or (lambda _p, a: jax.device_put(a)), bar))
    cfg = ModelConfig.from_pretrained(path)
    jdtype = resolve_dtype(dtype)
    model = nnx.eval_shape(lambda: DeepseekV3(cfg, dtype=jdtype, rngs=nnx.Rngs(0)))
    with load_progress(path, len(nnx.to_flat_state(nnx.state(model)))) as bar:
        load_hf_weights(model, cfg, path, put=_counted(put or (lambda _p, a: jnp.asarray(a)), bar))
    return model, cfg


def _counted(put: Callable[[tuple, np.ndarray], jax.Array], bar) -> Callable[[tuple, np.ndarray], jax.Array]:
    """put, advancing the progress bar by one parameter per call (each loader puts every parameter once)."""
    def counted(param_path: tuple, host_array: np.ndarray) -> jax.Array:
        out = put(param_path, host_array)
        bar.update(1)
        return out
    return counted
