"""Load Hugging Face DeepSeek-V3/V2 safetensors checkpoints into the NNX model.

`hf_param_map(cfg)` is THE table from HF tensor names to model parameters; everything else (AWQ tensors, sharding
rules, converters) should go through it. `load_hf_weights` fills a model (usually built abstractly with
`nnx.eval_shape`: checkpoint/load.py) after checking every tensor's name and shape from the safetensors headers,
before reading any data. It then streams tensor by tensor: one tensor in host memory at a time, except that
per-expert HF tensors are gathered into one host buffer [E, ...] per stacked parameter before it is placed on the
device. Its slice-reading hook builds each parameter from slices instead (checkpoint/sharded.py).
"""

from __future__ import annotations

import contextlib
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

from mla_jax.checkpoint.errors import CheckpointError, open_safetensors, read_json
from mla_jax.checkpoint.targets import ParamTarget
from mla_jax.config import ModelConfig
from mla_jax.quant.awq import awq_linear_targets

logger = logging.getLogger(__name__)

_FLOAT_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}
_INT_DTYPES = {"I32": np.int32, "I8": np.int8, "U8": np.uint8, "I16": np.int16, "I64": np.int64}
# Non-parameter buffers some exporters write; they carry no information we use.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _linear(cfg: ModelConfig, hf_module: str, module: tuple, param: str, in_f: int, out_f: int,
            expert: int | None = None) -> dict[str, ParamTarget]:
    """Targets of one decoder linear (HF module name without '.weight')."""
    q = cfg.quantization
    # Routed experts are one stacked module per layer, so AWQ exclusion is decided for the block as a whole.
    decided_by = hf_module if expert is None else hf_module.rsplit(".", 2)[0]  # "model.layers.i.mlp.experts"
    if q is not None and not q.excludes(decided_by):
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
        weight_map = read_json(index, "the checkpoint's shard index").get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(index, "has no \"weight_map\" object of tensor name -> shard file",
                                  "download the index again, or remove it to load every *.safetensors file")
        files = sorted(set(weight_map.values()))
        missing = [fn for fn in files if not os.path.isfile(os.path.join(path, fn))]
        if missing:
            raise FileNotFoundError(f"{index} names {len(missing)} shard(s) that are not in {path}: "
                                    f"{', '.join(missing)}; download the missing shard(s) into that directory")
        return [os.path.join(path, fn) for fn in files]
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    files = sorted(fn for fn in os.listdir(path) if fn.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path} (expected model.safetensors or "
                                f"model.safetensors.index.json); download the weights into that directory, or "
                                f"give the directory that holds them")
    return [os.path.join(path, fn) for fn in files]


def read_tensor_index(path: str | os.PathLike) -> dict[str, tuple[str, tuple[int, ...], str]]:
    """tensor name -> (file, shape, safetensors dtype), from headers only (no tensor data is read)."""
    out: dict[str, tuple[str, tuple[int, ...], str]] = {}
    for fn in safetensors_files(path):
        with open_safetensors(fn) as f:
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
    from_slices: Callable[[tuple, tuple, Any, Callable[[tuple], np.ndarray]], jax.Array] | None = None,
) -> nnx.Module:
    """Fill `model` (abstract from nnx.eval_shape, or concrete) with the HF checkpoint at `path`, in place.

    put(param_path, host_array) -> jax.Array places each finished parameter (default: jnp.asarray on the default
    device); the converter passes one that writes it to disk.
    from_slices(param_path, shape, dtype, read_slice) -> jax.Array, instead of put: the slice-reading hook. Each
    parameter is built from slices rather than whole tensors: read_slice(index) returns the parameter's slice
    `index` (a tuple of slices, one per axis) in the model's layout, reading only that part of the checkpoint
    where the layout allows it. checkpoint/sharded.py passes jax.make_array_from_callback with the parameter's
    sharding, so no process holds a full copy of a sharded weight. The checks are the same either way."""
    if put is not None and from_slices is not None:
        raise ValueError("load_hf_weights: pass put or from_slices, not both")
    targets = hf_param_map(cfg)
    to_load = _check_tensor_index(targets, read_tensor_index(path), cfg, path)
    model_dtype = np.dtype(getattr(model, "dtype", np.float32))
    if from_slices is None:
        _stream_tensors(model, targets, to_load, model_dtype, put or (lambda _path, a: jnp.asarray(a)))
    else:
        _assemble_from_slices(model, targets, to_load, model_dtype, from_slices)
    # Every parameter must now be concrete.
    for p, v in nnx.to_flat_state(nnx.state(model)):
        if isinstance(v.get_value(), jax.ShapeDtypeStruct):
            raise ValueError(f"parameter {p} was not filled by any checkpoint tensor (hf_param_map is incomplete)")
    return model


def _check_tensor_index(targets: dict[str, ParamTarget], index: dict, cfg: ModelConfig,
                        path: str | os.PathLike) -> dict[str, tuple[str, tuple[int, ...], str]]:
    """Validates names and shapes from the headers before any data is read; returns the tensors to load."""
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
    return to_load


def _stream_tensors(model: nnx.Module, targets: dict[str, ParamTarget], to_load: dict, model_dtype: np.dtype,
                    put: Callable[[tuple, np.ndarray], jax.Array]) -> None:
    """Reads whole tensors file by file; per-expert tensors are stacked in a host buffer until complete."""
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

    # Parameters filled by several tensors (per-expert stacks, column parts) wait in a host buffer until complete.
    parts_of: dict[tuple, int] = {}
    for t in targets.values():
        if t.expert is not None or t.columns is not None:
            parts_of[t.path] = parts_of.get(t.path, 0) + 1

    for fn, names in by_file.items():  # files in index order (read_tensor_index walked safetensors_files)
        with open_safetensors(fn) as f:
            for name in names:
                t = targets[name]
                arr = _convert(f.get_tensor(name), to_load[name][2], t, model_dtype, name)
                if t.path not in parts_of:
                    assign(t, arr)
                    continue
                var = getattr(_module_at(model, t.module), t.param)
                buf, seen = stacks.get(t.path) or (np.empty(tuple(var.shape), arr.dtype), set())
                dst = buf if t.expert is None else buf[t.expert]
                if t.columns is not None:
                    dst = dst[..., t.columns[0]: t.columns[0] + t.columns[1]]
                dst[...] = arr
                seen.add((t.expert, t.columns))
                stacks[t.path] = (buf, seen)
                if len(seen) == parts_of[t.path]:
                    assign(t, buf)
                    del stacks[t.path]
                del arr
    if stacks:  # unreachable when the map and the validation agree; kept as a guard
        raise ValueError(f"incomplete expert stacks: {sorted(map(str, stacks))}")


def _assemble_from_slices(model: nnx.Module, targets: dict[str, ParamTarget], to_load: dict,
                          model_dtype: np.dtype, from_slices: Callable) -> None:
    """Builds every parameter with from_slices(param_path, shape, dtype, read_slice) (see load_hf_weights)."""
    groups: dict[tuple, dict] = {}          # param path -> {expert index or None: [hf names, by column start]}
    for name, t in targets.items():
        groups.setdefault(t.path, {}).setdefault(t.expert, []).append(name)
    for names in groups.values():
        for parts in names.values():
            parts.sort(key=lambda n: targets[n].columns or (0, 0))

    with contextlib.ExitStack() as stack:
        files: dict[str, Any] = {}

        def read(name: str, idx: tuple | None) -> np.ndarray:
            fn = to_load[name][0]
            if fn not in files:
                files[fn] = stack.enter_context(open_safetensors(fn))
            sl = files[fn].get_slice(name)
            return sl[idx] if idx is not None else sl[:]

        def piece(name: str, our_index: tuple, our_shape: tuple) -> np.ndarray:
            """Our parameter's slice `our_index` of the (per-expert) tensor `name`."""
            t = targets[name]
            # a converted layout (AWQ -> the packed w4a16 layout) is built from the whole tensor, then cut
            hf_idx = None if t.convert else _hf_index(our_index, our_shape, t.hf_shape, t.transpose)
            arr = _convert(read(name, hf_idx), to_load[name][2], t, model_dtype, name)
            if hf_idx is None:
                arr = arr[our_index]
            want = tuple(len(range(*s.indices(n))) for s, n in zip(our_index, our_shape))
            if arr.shape != want:
                raise ValueError(f"internal: slice {our_index} of {name} converted to shape {arr.shape}, "
                                 f"expected {want}")
            return arr

        def part(parts: list[str], idx: tuple, shape: tuple) -> np.ndarray:
            """Slice `idx` of one (per-expert) parameter of `shape` made of one tensor or of column parts."""
            if len(parts) == 1 and targets[parts[0]].columns is None:
                return piece(parts[0], idx, shape)
            full = [piece(n, (slice(None),) * len(shape), shape[:-1] + (targets[n].columns[1],)) for n in parts]
            return np.concatenate(full, axis=-1)[idx]

        for ppath, names in groups.items():
            t0 = targets[names[next(iter(names))][0]]
            var = getattr(_module_at(model, t0.module), t0.param)
            current = var.get_value()
            shape, pdtype = tuple(current.shape), current.dtype
            if None in names:                                 # HF tensor(s) -> the whole parameter
                def read_slice(idx, parts=names[None], shape=shape):
                    return part(parts, idx, shape)
            else:                                             # per-expert HF tensors -> stacked [E, ...]
                if sorted(names) != list(range(shape[0])):
                    raise ValueError(f"internal: experts of {ppath} in the name map: {sorted(names)}")

                def read_slice(idx, names=names, shape=shape):
                    experts = range(*idx[0].indices(shape[0]))
                    return np.stack([part(names[e], idx[1:], shape[1:]) for e in experts])
            var.set_value(from_slices(ppath, shape, pdtype, read_slice))


def _hf_index(our_index: tuple, our_shape: tuple, hf_shape: tuple, transpose: bool) -> tuple | None:
    """Map a slice of our parameter (per-expert part only) to a slice of the HF tensor, or None where the layout
    change does not allow it (then the whole tensor is read). Handles transposed kernels ([out, in] -> [in, out])
    and packed axes (AWQ int32 holding 8 int4 values: our axis is 8x the HF axis)."""
    axes = list(range(len(our_shape)))
    if transpose:
        axes = axes[::-1]
    hf_idx = [slice(None)] * len(hf_shape)
    for ours, sl in enumerate(our_index):
        hf_axis = axes[ours]
        start, stop, step = sl.indices(our_shape[ours])
        if step != 1:
            return None
        factor = our_shape[ours] // hf_shape[hf_axis]
        if factor * hf_shape[hf_axis] != our_shape[ours] or start % factor or stop % factor:
            return None
        hf_idx[hf_axis] = slice(start // factor, stop // factor)
    return tuple(hf_idx)


_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def resolve_dtype(dtype: Any) -> Any:
    """The model dtype a loader builds with: 'float32' / 'bfloat16' (or those dtypes) -> the jnp type."""
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype={dtype!r}: expected 'float32' or 'bfloat16' (float16 overflows DeepSeek "
                             f"activations, docs/architecture.md §6)")
        return _DTYPES[dtype]
    d = jnp.dtype(dtype)
    if d not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"dtype={dtype!r}: expected float32 or bfloat16")
    return d.type
