"""A model placed on a `ShardingPlan` as it is read or created, so no process ever holds a full copy of a sharded
weight (docs/architecture.md §7).

    load_sharded   HF safetensors (through load_hf_weights' slice-reading hook) or a converted directory
                   (through load_converted's sharding hook): each device's slice is read directly, and with
                   several processes each reads only what its own devices hold. Same checks as load_model.
    init_sharded   random initial weights generated on the devices (benchmarks without a checkpoint)
"""
from __future__ import annotations

import logging
import os

import jax
from flax import nnx

from mla_jax.checkpoint.converted import is_converted, load_converted
from mla_jax.checkpoint.files import load_progress, resolve_model_dir
from mla_jax.checkpoint.hf import load_hf_weights, resolve_dtype
from mla_jax.config import ModelConfig
from mla_jax.model.transformer import DeepseekV3
from mla_jax.sharding import ShardingPlan, check_config, path_str

logger = logging.getLogger(__name__)


def load_sharded(path, plan: ShardingPlan, dtype="float32"):
    """(model, cfg) from an HF checkpoint directory (or a converted one: `load_converted_sharded`) with every
    parameter placed by the plan's rules as it is read: each device's slice is read from the safetensors file
    directly (jax.make_array_from_callback over safetensors slices), so no process holds a full copy of a sharded
    weight, and with several processes each reads only what its own devices hold. Same checks as
    mla_jax.load_model (names, shapes, dtypes)."""
    path = resolve_model_dir(path)         # a path, or the name of an embedded model
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path} is not a directory; expected an HF model directory with config.json")
    if is_converted(path):
        return load_converted_sharded(path, plan, dtype)
    cfg = ModelConfig.from_pretrained(path)
    check_config(cfg, plan.num_devices, plan.data_parallel_attention)
    jdtype = resolve_dtype(dtype)
    model = nnx.eval_shape(lambda: DeepseekV3(cfg, dtype=jdtype, rngs=nnx.Rngs(0)))

    with load_progress(path, len(nnx.to_flat_state(nnx.state(model)))) as bar:
        def from_slices(param_path, shape, dtype, read_slice):
            sharding = plan.sharding(plan.param_spec(path_str(param_path), shape))
            out = jax.make_array_from_callback(shape, sharding, read_slice, dtype=dtype)
            bar.update(1)
            return out

        load_hf_weights(model, cfg, path, from_slices=from_slices)
    return model, cfg


def load_converted_sharded(path, plan: ShardingPlan, dtype="float32"):
    """(model, cfg) from a directory written by scripts/convert.py (mla_jax.checkpoint.converted), restored by
    orbax straight into the plan's shardings: tensorstore reads each device's slice, so no process holds a full
    copy of a sharded weight. Names, shapes and dtypes are checked against the manifest and the model as in
    `load_converted`; the per-tensor crc32 (of whole arrays) is not, since no process sees a whole sharded array
    — verify a copied checkpoint once with mla_jax.checkpoint.converted.load_converted(verify_checksums=True)."""
    path = os.fspath(path)
    check_config(ModelConfig.from_pretrained(path), plan.num_devices, plan.data_parallel_attention)

    def sharding_for(param_path, shape):
        return plan.sharding(plan.param_spec(path_str(param_path), shape))

    model, cfg = load_converted(path, dtype, verify_checksums=False, sharding_for=sharding_for)
    logger.info("restored %s sharded over %d devices (crc32 not verified in the sharded path)", path,
                plan.num_devices)
    return model, cfg


def init_sharded(cfg, plan: ShardingPlan, dtype, seed: int = 0):
    """DeepseekV3(cfg) with its random initial weights (AWQ int4 for quantized configs) created directly in the
    plan's shardings: the init runs under jit with those output shardings, so each device generates only its
    own part (benchmarks of full-size models without a checkpoint)."""
    check_config(cfg, plan.num_devices, plan.data_parallel_attention)
    abstract = nnx.eval_shape(lambda: DeepseekV3(cfg, dtype=dtype, rngs=nnx.Rngs(seed)))
    graphdef, abstract_state = nnx.split(abstract)
    state = jax.jit(lambda: nnx.state(DeepseekV3(cfg, dtype=dtype, rngs=nnx.Rngs(seed))),
                    out_shardings=plan.param_shardings(abstract_state))()
    return nnx.merge(graphdef, state)
