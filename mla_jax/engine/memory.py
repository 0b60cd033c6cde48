"""Memory accounting of the engine over a sharding plan, without allocating anything: full-size dry runs and
reports (scripts/run_full_v3.py)."""
from __future__ import annotations

import math

import jax
from flax import nnx

from mla_jax.model.transformer import DeepseekV3
from mla_jax.sharding import ShardingPlan, bytes_per_device, dtype_bits, path_str
from .steps import EngineWeights, allocate_caches


def _category(path: str) -> str:
    if "/self_attn/" in path:
        return "attention"
    if "/mlp/experts/" in path:
        return "routed_experts"
    if "/mlp/shared_experts/" in path:
        return "shared_experts"
    if "/mlp/gate/" in path:
        return "router"
    if "/mlp/" in path:
        return "dense_mlp"
    if path.startswith(("embed_tokens/", "lm_head/")):
        return "embed_lm_head"
    return "norms"


def abstract_engine_state(cfg, dtype, *, num_pages: int, page_size: int = 64, cache_dtype: str = "fp8_e4m3"):
    """(graphdef, EngineWeights, caches) of the engine as ShapeDtypeStructs: the model built by nnx.eval_shape,
    the absorbed W_UK / W_UV and the per-layer caches by jax.eval_shape. Nothing is allocated."""
    model = nnx.eval_shape(lambda: DeepseekV3(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)

    def absorbed(state):
        m = nnx.merge(graphdef, state)
        return tuple(tuple(layer.self_attn.absorbed_weights()) for layer in m.layers)

    weights = EngineWeights(state, jax.eval_shape(absorbed, state))
    caches = jax.eval_shape(lambda: allocate_caches(cfg, num_pages, page_size=page_size, dtype=cache_dtype))
    return graphdef, weights, caches


def memory_per_device(plan: ShardingPlan, weights, caches) -> dict[str, int]:
    """Bytes one device holds, by category, for abstract (or concrete) engine weights and caches laid out by the
    plan (device 0; with these rules every device holds the same amount)."""
    out: dict[str, int] = {}
    shardings = plan.engine_weight_shardings(weights)

    def add(kp, a, s):
        cat = _category(path_str(kp))
        out[cat] = out.get(cat, 0) + math.prod(s.shard_shape(a.shape)) * dtype_bits(a.dtype) // 8

    jax.tree_util.tree_map_with_path(add, weights.model, shardings.model)
    out["absorbed_w_uk_w_uv"] = bytes_per_device(weights.absorbed, shardings.absorbed)
    out["weights_total"] = sum(out.values())
    out["kv_cache"] = bytes_per_device(caches, plan.cache_shardings(caches))
    out["total"] = out["weights_total"] + out["kv_cache"]
    return out
