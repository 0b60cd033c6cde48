"""Load Hugging Face DeepSeek-V3/V2 safetensors checkpoints into the NNX model.

`hf_param_map(cfg)` is THE table from HF tensor names to model parameters; everything else (AWQ tensors, sharding
rules, converters) should go through it. The loader builds the model abstractly (`nnx.eval_shape`, no memory),
checks every tensor's name and shape from the safetensors headers before reading any data, then streams tensor by
tensor: one tensor in host memory at a time, except that per-expert HF tensors are gathered into one host buffer
[E, ...] per stacked parameter before it is placed on the device.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import safe_open

from mla_jax.config import ModelConfig

logger = logging.getLogger(__name__)

_FLOAT_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}
_INT_DTYPES = {"I32": np.int32, "I8": np.int8, "U8": np.uint8, "I16": np.int16, "I64": np.int64}
# Non-parameter buffers some exporters write; they carry no information we use.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclasses.dataclass(frozen=True)
class ParamTarget:
    """Where one HF tensor goes.

    module: path of the owning module in the NNX tree, e.g. ('layers', 3, 'self_attn', 'q_a_proj');
    param: attribute name on it ('kernel', 'weight', 'embedding', 'w_gate', 'e_score_correction_bias', ...);
    hf_shape: the tensor's shape in the checkpoint; transpose: HF [out, in] -> our [in, out];
    expert: index into the stacked leading expert axis (per-expert HF tensors), else None;
    dtype: None -> the model dtype; otherwise a fixed dtype name ('float32' for the router, 'int32' for packed
    AWQ weights, ...); quantizable: a decoder linear that AWQ may replace (router/embeddings/norms/lm_head not).
    """

    module: tuple[str | int, ...]
    param: str
    hf_shape: tuple[int, ...]
    transpose: bool = False
    expert: int | None = None
    dtype: str | None = None
    quantizable: bool = False
    # AWQ hook (mla_jax.quant.awq.awq_linear_targets): when set, convert(host_array) -> final host array (layout
    # and dtype, e.g. int32-packed AWQ -> int4); transpose/dtype are then not applied.
    convert: Callable[[np.ndarray], np.ndarray] | None = None

    @property
    def path(self) -> tuple[str | int, ...]:
        return self.module + (self.param,)


def _linear(cfg: ModelConfig, hf_module: str, module: tuple, param: str, in_f: int, out_f: int,
            expert: int | None = None) -> dict[str, ParamTarget]:
    """Targets of one decoder linear (HF module name without '.weight')."""
    q = cfg.quantization
    # Routed experts are one stacked module per layer, so AWQ exclusion is decided for the block as a whole.
    decided_by = hf_module if expert is None else hf_module.rsplit(".", 2)[0]  # "model.layers.i.mlp.experts"
    if q is not None and not q.excludes(decided_by):
        try:
            from mla_jax.quant.awq import awq_linear_targets
        except ImportError as e:
            raise NotImplementedError(
                f"{hf_module}: AWQ checkpoint, but mla_jax.quant.awq.awq_linear_targets is not available ({e})"
            ) from e
        return awq_linear_targets(q, hf_module, module, param, in_f, out_f, expert)
    return {f"{hf_module}.weight": ParamTarget(module, param, (out_f, in_f), transpose=True, expert=expert,
                                               quantizable=True)}


def hf_param_map(cfg: ModelConfig) -> dict[str, ParamTarget]:
    """HF tensor name -> ParamTarget for every parameter of `DeepseekV3(cfg)` (MTP layers excluded)."""
    D, H, V = cfg.hidden_size, cfg.num_attention_heads, cfg.vocab_size
    N, R, C, Vh = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank, cfg.v_head_dim
    m: dict[str, ParamTarget] = {
        "model.embed_tokens.weight": ParamTarget(("embed_tokens",), "embedding", (V, D)),
        "model.norm.weight": ParamTarget(("norm",), "weight", (D,)),
    }
    if not cfg.tie_word_embeddings:
        m["lm_head.weight"] = ParamTarget(("lm_head",), "kernel", (V, D), transpose=True)

    def mlp(hf: str, mod: tuple, inter: int) -> None:
        m.update(_linear(cfg, f"{hf}.gate_proj", mod + ("gate_proj",), "kernel", D, inter))
        m.update(_linear(cfg, f"{hf}.up_proj", mod + ("up_proj",), "kernel", D, inter))
        m.update(_linear(cfg, f"{hf}.down_proj", mod + ("down_proj",), "kernel", inter, D))

    for i in range(cfg.num_hidden_layers):
        hf, L = f"model.layers.{i}", ("layers", i)
        m[f"{hf}.input_layernorm.weight"] = ParamTarget(L + ("input_layernorm",), "weight", (D,))
        m[f"{hf}.post_attention_layernorm.weight"] = ParamTarget(L + ("post_attention_layernorm",), "weight", (D,))
        a, A = f"{hf}.self_attn", L + ("self_attn",)
        if cfg.q_lora_rank is None:
            m.update(_linear(cfg, f"{a}.q_proj", A + ("q_proj",), "kernel", D, H * (N + R)))
        else:
            m.update(_linear(cfg, f"{a}.q_a_proj", A + ("q_a_proj",), "kernel", D, cfg.q_lora_rank))
            m[f"{a}.q_a_layernorm.weight"] = ParamTarget(A + ("q_a_layernorm",), "weight", (cfg.q_lora_rank,))
            m.update(_linear(cfg, f"{a}.q_b_proj", A + ("q_b_proj",), "kernel", cfg.q_lora_rank, H * (N + R)))
        m.update(_linear(cfg, f"{a}.kv_a_proj_with_mqa", A + ("kv_a_proj_with_mqa",), "kernel", D, C + R))
        m[f"{a}.kv_a_layernorm.weight"] = ParamTarget(A + ("kv_a_layernorm",), "weight", (C,))
        m.update(_linear(cfg, f"{a}.kv_b_proj", A + ("kv_b_proj",), "kernel", C, H * (N + Vh)))
        m.update(_linear(cfg, f"{a}.o_proj", A + ("o_proj",), "kernel", H * Vh, D))

        P = L + ("mlp",)
        if not cfg.is_moe_layer(i):
            mlp(f"{hf}.mlp", P, cfg.intermediate_size)
            continue
        E, I = cfg.n_routed_experts, cfg.moe_intermediate_size
        m[f"{hf}.mlp.gate.weight"] = ParamTarget(P + ("gate",), "kernel", (E, D), transpose=True, dtype="float32")
        if cfg.topk_method == "noaux_tc":
            m[f"{hf}.mlp.gate.e_score_correction_bias"] = ParamTarget(
                P + ("gate",), "e_score_correction_bias", (E,), dtype="float32")
        X = P + ("experts",)
        for j in range(E):
            e = f"{hf}.mlp.experts.{j}"
            m.update(_linear(cfg, f"{e}.gate_proj", X, "w_gate", D, I, expert=j))
            m.update(_linear(cfg, f"{e}.up_proj", X, "w_up", D, I, expert=j))
            m.update(_linear(cfg, f"{e}.down_proj", X, "w_down", I, D, expert=j))
        if cfg.n_shared_experts:
            mlp(f"{hf}.mlp.shared_experts", P + ("shared_experts",), I * cfg.n_shared_experts)
    return m


# ---- reading safetensors ----------------------------------------------------------------------------------------
def safetensors_files(path: str | os.PathLike) -> list[str]:
    """The checkpoint's safetensors files: from model.safetensors.index.json, or model.safetensors, or the
    directory's only *.safetensors files."""
    path = os.fspath(path)
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = sorted(set(weight_map.values()))
        missing = [fn for fn in files if not os.path.isfile(os.path.join(path, fn))]
        if missing:
            raise FileNotFoundError(f"{index} names shard(s) that do not exist: {', '.join(missing)}")
        return [os.path.join(path, fn) for fn in files]
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    files = sorted(fn for fn in os.listdir(path) if fn.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path} (expected model.safetensors or "
                                f"model.safetensors.index.json)")
    return [os.path.join(path, fn) for fn in files]


def read_tensor_index(path: str | os.PathLike) -> dict[str, tuple[str, tuple[int, ...], str]]:
    """tensor name -> (file, shape, safetensors dtype), from headers only (no tensor data is read)."""
    out: dict[str, tuple[str, tuple[int, ...], str]] = {}
    for fn in safetensors_files(path):
        with safe_open(fn, framework="numpy") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                if name in out:
                    raise ValueError(f"tensor {name!r} appears in both {out[name][0]} and {fn}")
                out[name] = (fn, tuple(int(s) for s in sl.get_shape()), str(sl.get_dtype()))
    return out


def _mtp_layer(name: str, cfg: ModelConfig) -> bool:
    mt = re.match(r"model\.layers\.(\d+)\.", name)
    if not mt:
        return False
    k = int(mt.group(1))
    return cfg.num_hidden_layers <= k < cfg.num_hidden_layers + cfg.num_nextn_predict_layers


def _module_at(model: nnx.Module, module_path: tuple) -> Any:
    obj = model
    for p in module_path:
        obj = obj[p] if isinstance(p, int) else getattr(obj, p)
    return obj


def _convert(arr: np.ndarray, st_dtype: str, target: ParamTarget, model_dtype: np.dtype, name: str) -> np.ndarray:
    if target.convert is not None:
        return target.convert(arr)
    if target.dtype is not None and jnp.issubdtype(np.dtype(target.dtype), np.integer):
        if st_dtype not in _INT_DTYPES:
            raise ValueError(f"tensor {name!r} has dtype {st_dtype}; expected an integer tensor ({target.dtype})")
        return arr.astype(np.dtype(target.dtype), copy=False)
    if st_dtype not in _FLOAT_DTYPES:
        raise ValueError(
            f"tensor {name!r} has dtype {st_dtype}; only BF16, F16 and F32 weights are supported (FP8 checkpoints "
            f"must be dequantized or converted to AWQ first)"
        )
    want = np.dtype(target.dtype) if target.dtype is not None else model_dtype
    if target.transpose:
        arr = arr.T
    return np.ascontiguousarray(arr.astype(want, copy=False))


def load_hf_weights(
    model: nnx.Module,
    cfg: ModelConfig,
    path: str | os.PathLike,
    *,
    put: Callable[[tuple, np.ndarray], jax.Array] | None = None,
) -> nnx.Module:
    """Fill `model` (abstract from nnx.eval_shape, or concrete) with the HF checkpoint at `path`, in place.

    put(param_path, host_array) -> jax.Array places each finished parameter (default: jnp.asarray on the default
    device); a sharded loader passes one that device_puts with the parameter's sharding."""
    put = put or (lambda _path, a: jnp.asarray(a))
    targets = hf_param_map(cfg)
    index = read_tensor_index(path)
    model_dtype = np.dtype(getattr(model, "dtype", np.float32))

    # 1. Validate names and shapes from headers before reading any data.
    skipped_mtp = 0
    to_load: dict[str, tuple[str, tuple[int, ...], str]] = {}
    for name, (fn, shape, st_dtype) in index.items():
        if name in targets:
            want = targets[name].hf_shape
            if tuple(shape) != tuple(want):
                raise ValueError(f"tensor {name!r} in {os.path.basename(fn)} has shape {tuple(shape)}, but the model "
                                 f"(from config.json) expects shape {tuple(want)}")
            to_load[name] = (fn, shape, st_dtype)
        elif _mtp_layer(name, cfg):
            skipped_mtp += 1
        elif name.endswith(_IGNORED_SUFFIXES):
            continue
        elif name == "lm_head.weight" and cfg.tie_word_embeddings:
            logger.info("tie_word_embeddings=true: ignoring lm_head.weight, logits use model.embed_tokens.weight")
        else:
            raise ValueError(f"unexpected tensor {name!r} with shape {tuple(shape)} in {os.path.basename(fn)}: "
                             f"no parameter of the model (from config.json) has that name, expected shape: none; "
                             f"check that config.json belongs to this checkpoint")
    missing = [n for n in targets if n not in to_load]
    if missing:
        shown = "; ".join(f"{n} (expected shape {targets[n].hf_shape}, found: none)" for n in missing[:8])
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise ValueError(f"checkpoint {os.fspath(path)} is missing {len(missing)} tensor(s): {shown}{more}")
    if skipped_mtp:
        logger.info("skipped %d tensors of %d multi-token-prediction layer(s)", skipped_mtp,
                    cfg.num_nextn_predict_layers)

    # 2. Stream tensors file by file; stack per-expert tensors in a host buffer until complete.
    stacks: dict[tuple, tuple[np.ndarray, set[int]]] = {}
    by_file: dict[str, list[str]] = {}
    for name, (fn, _, _) in to_load.items():
        by_file.setdefault(fn, []).append(name)

    def assign(t: ParamTarget, value: np.ndarray) -> None:
        var = getattr(_module_at(model, t.module), t.param)
        have = tuple(var.shape)
        if have != tuple(value.shape):
            raise ValueError(f"internal: parameter {t.path} has shape {have}, converted tensor {value.shape}")
        var.set_value(put(t.path, value))

    for fn, names in by_file.items():  # files in index order (read_tensor_index walked safetensors_files)
        with safe_open(fn, framework="numpy") as f:
            for name in names:
                t = targets[name]
                arr = _convert(f.get_tensor(name), to_load[name][2], t, model_dtype, name)
                if t.expert is None:
                    assign(t, arr)
                    continue
                var = getattr(_module_at(model, t.module), t.param)
                buf, seen = stacks.get(t.path) or (np.empty(tuple(var.shape), arr.dtype), set())
                buf[t.expert] = arr
                seen.add(t.expert)
                stacks[t.path] = (buf, seen)
                if len(seen) == var.shape[0]:
                    assign(t, buf)
                    del stacks[t.path]
                del arr
    if stacks:  # unreachable when the map and the validation agree; kept as a guard
        raise ValueError(f"incomplete expert stacks: {sorted(map(str, stacks))}")

    # 3. Every parameter must now be concrete.
    for p, v in nnx.to_flat_state(nnx.state(model)):
        if isinstance(v.get_value(), jax.ShapeDtypeStruct):
            raise ValueError(f"parameter {p} was not filled by any checkpoint tensor (hf_param_map is incomplete)")
    return model


_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def _resolve_dtype(dtype: Any) -> Any:
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype={dtype!r}: expected 'float32' or 'bfloat16' (float16 overflows DeepSeek "
                             f"activations, DESIGN.md §8)")
        return _DTYPES[dtype]
    d = jnp.dtype(dtype)
    if d not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"dtype={dtype!r}: expected float32 or bfloat16")
    return d.type


def load_model(path: str | os.PathLike, dtype: Any = "float32", *,
               put: Callable[[tuple, np.ndarray], jax.Array] | None = None):
    """HF directory (config.json + *.safetensors) -> (DeepseekV3 model, ModelConfig)."""
    from mla_jax.model.transformer import DeepseekV3

    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path} is not a directory; expected an HF model directory with config.json")
    from mla_jax.checkpoint.converted import is_converted, load_converted  # scripts/convert.py output
    if is_converted(path):
        return load_converted(path, dtype, put=put)
    cfg = ModelConfig.from_pretrained(path)
    jdtype = _resolve_dtype(dtype)
    model = nnx.eval_shape(lambda: DeepseekV3(cfg, dtype=jdtype, rngs=nnx.Rngs(0)))
    load_hf_weights(model, cfg, path, put=put)
    return model, cfg
