"""AutoAWQ "GEMM" packing on the host (numpy): quantize, pack, unpack, dequantize, and whole-checkpoint packing.

The format (docs/architecture.md §6, AutoAWQ `WQLinear_GEMM`):
  qweight int32 [in, out/8]    eight 4-bit values per int32 along the output axis
  qzeros  int32 [in/G, out/8]  the zero point of each (group, column), packed the same way
  scales  fp16  [in/G, out]
  W[i, n] = (q[i, n] - z[i // G, n]) * s[i // G, n]   and   y = x @ W.
Packing: within each int32, nibble slot k (bits 4k..4k+3) holds logical column 8·c + AWQ_PACK_ORDER[k], so
logical column n sits at bit shift 4·AWQ_UNPACK_SLOT[n % 8].

The quantizer follows AutoAWQ's round-to-nearest zero-point path (`pseudo_quantize_tensor` then
`WQLinear_GEMM.from_linear`), per output row and per group of G input columns of the torch weight [out, in]:
  s = clamp(max - min, 1e-5) / 15;  z = clamp(-round(min / s), 0, 15);  q = clamp(round(w / s) + z, 0, 15).
AutoAWQ computes s in the model's dtype and stores it as fp16; we round s to fp16 first and derive z and q from
that stored value, so the checkpoint's (q, z, s) are exactly what the dequantization sees. Rounding is
round-half-to-even (torch.round and numpy.rint agree). AWQ's activation-aware scale search is not done here:
this packer makes valid AWQ checkpoints from fp weights (test fixtures, synthetic models), it does not
calibrate.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from typing import Iterable, Optional, Sequence

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy: safetensors.numpy reads bf16 checkpoints)
import numpy as np

from mla_jax.checkpoint.errors import load_safetensors, read_json
from mla_jax.checkpoint.files import replace_dir

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble slot k holds logical column AWQ_PACK_ORDER[k]
AWQ_UNPACK_SLOT = tuple(AWQ_PACK_ORDER.index(n) for n in range(8))  # = (0, 4, 1, 5, 2, 6, 3, 7)
PACK = 8  # 4-bit values per int32
MAX_INT = 15

# HF DeepSeek-V2/V3 module names that are nn.Linear inside a decoder layer: the modules AutoAWQ quantizes.
# Not matched (never quantized): mlp.gate (the router, a custom MoEGate), norms, embed_tokens, lm_head.
_QUANTIZABLE_RE = re.compile(
    r"^model\.layers\.\d+\."
    r"(self_attn\.(q_a_proj|q_b_proj|q_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)"
    r"|mlp\.(shared_experts\.|experts\.\d+\.)?(gate_proj|up_proj|down_proj))$"
)


def is_quantizable_linear(module_name: str) -> bool:
    """True for the HF module names of the decoder Linears that AWQ quantizes (attention, MLPs, experts)."""
    return _QUANTIZABLE_RE.match(module_name) is not None


def is_excluded(module_name: str, modules_to_not_convert: Optional[Iterable[str]]) -> bool:
    """AutoAWQ / vLLM semantics of `modules_to_not_convert`: a module stays unquantized when any listed string
    is a substring of its full name (e.g. "kv_b_proj" or "model.layers.0.")."""
    return any(key in module_name for key in (modules_to_not_convert or ()))


# ----------------------------------------------------------------------------------------------------------------
# pack / unpack


def pack_int4(values: np.ndarray) -> np.ndarray:
    """[rows, cols] integers in [0, 15] -> int32 [rows, cols/8] in AWQ order."""
    values = np.asarray(values)
    if values.ndim != 2 or values.shape[1] % PACK:
        raise ValueError(f"pack_int4 needs a 2-D array with a multiple of 8 columns, got shape {values.shape}")
    if values.size and (values.min() < 0 or values.max() > MAX_INT):
        raise ValueError(f"pack_int4 values must lie in [0, 15], got [{values.min()}, {values.max()}]")
    v = values.astype(np.uint32).reshape(values.shape[0], -1, PACK)
    packed = np.zeros(v.shape[:2], np.uint32)
    for slot, col in enumerate(AWQ_PACK_ORDER):
        packed |= v[:, :, col] << np.uint32(4 * slot)
    return packed.view(np.int32)


def unpack_int4(packed: np.ndarray) -> np.ndarray:
    """int32 [rows, cols/8] in AWQ order -> uint8 [rows, cols] with values in [0, 15] (logical column order)."""
    packed = np.asarray(packed)
    if packed.dtype != np.int32 or packed.ndim != 2:
        raise ValueError(f"unpack_int4 needs a 2-D int32 array, got {packed.dtype} {packed.shape}")
    u = packed.view(np.uint32)
    shifts = np.asarray([4 * s for s in AWQ_UNPACK_SLOT], np.uint32)  # logical column n%8 -> bit shift
    out = (u[:, :, None] >> shifts[None, None, :]) & np.uint32(0xF)
    return out.reshape(packed.shape[0], -1).astype(np.uint8)


# ----------------------------------------------------------------------------------------------------------------
# quantize / dequantize


def quantize_rtn(weight: np.ndarray, group_size: int):
    """AutoAWQ RTN zero-point quantization of a torch-layout weight [out, in].

    Returns (q uint8 [in, out], zeros uint8 [in/G, out], scales float16 [in/G, out]) in our x @ W layout.
    """
    w = np.asarray(weight, np.float32)
    if w.ndim != 2:
        raise ValueError(f"quantize_rtn needs a 2-D weight [out, in], got shape {w.shape}")
    n_out, n_in = w.shape
    if group_size <= 0 or n_in % group_size:
        raise ValueError(f"group_size {group_size} does not divide in_features {n_in}")
    if not np.isfinite(w).all():
        raise ValueError("weight holds NaN or inf; AWQ quantization needs finite weights")
    g = w.reshape(n_out, n_in // group_size, group_size)
    wmax = g.max(axis=2, keepdims=True)
    wmin = g.min(axis=2, keepdims=True)
    scales = (np.maximum(wmax - wmin, 1e-5) / MAX_INT).astype(np.float16)  # stored as fp16 by from_linear
    s = scales.astype(np.float32)
    zeros = np.clip(-np.rint(wmin / s), 0, MAX_INT)
    q = np.clip(np.rint(g / s) + zeros, 0, MAX_INT)
    q = q.reshape(n_out, n_in).T.astype(np.uint8)  # [in, out]
    return q, zeros[..., 0].T.astype(np.uint8), scales[..., 0].T.copy()


def dequantize(q: np.ndarray, zeros: np.ndarray, scales: np.ndarray, group_size: int) -> np.ndarray:
    """(q - z[g]) * s[g] in float32: q [in, out] ints, zeros/scales [in/G, out] -> W [in, out]."""
    q = np.asarray(q, np.float32)
    z = np.repeat(np.asarray(zeros, np.float32), group_size, axis=0)
    s = np.repeat(np.asarray(scales).astype(np.float32), group_size, axis=0)
    return (q - z) * s


def dequantize_packed(qweight, qzeros, scales, group_size: int) -> np.ndarray:
    """Dequantize checkpoint tensors (qweight int32 [in, out/8], qzeros int32 [in/G, out/8], scales [in/G, out])."""
    return dequantize(unpack_int4(qweight), unpack_int4(qzeros), scales, group_size)


def pack_linear(weight: np.ndarray, group_size: int) -> dict:
    """torch-layout weight [out, in] -> {"qweight", "qzeros", "scales"} as WQLinear_GEMM.from_linear stores them."""
    n_out = np.shape(weight)[0]
    if n_out % PACK:
        raise ValueError(f"out_features {n_out} is not a multiple of 8; AWQ GEMM packs 8 columns per int32")
    q, z, s = quantize_rtn(weight, group_size)
    return {"qweight": pack_int4(q), "qzeros": pack_int4(z), "scales": s}


# ----------------------------------------------------------------------------------------------------------------
# whole checkpoints


def _weight_files(src_dir: str) -> list[str]:
    index = os.path.join(src_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        return sorted(set(read_json(index, "the checkpoint's shard index")["weight_map"].values()))
    if os.path.exists(os.path.join(src_dir, "model.safetensors")):
        return ["model.safetensors"]
    raise FileNotFoundError(f"{src_dir} holds neither model.safetensors nor model.safetensors.index.json")


def quantize_checkpoint(
    src_dir: str,
    dst_dir: str,
    *,
    group_size: int = 128,
    modules_to_not_convert: Sequence[str] = (),
    force: bool = False,
) -> dict:
    """Turn an HF DeepSeek checkpoint directory into an AutoAWQ GEMM checkpoint directory.

    Every decoder Linear (`is_quantizable_linear`) not excluded by `modules_to_not_convert` (substring match)
    becomes qweight/qzeros/scales; its bias, if any, is kept as fp16 (as from_linear does). Everything else
    (router gate, norms, embeddings, lm_head, e_score_correction_bias) is copied unchanged. config.json gets
    `quantization_config`; other non-weight files (tokenizer, generation config) are copied. Shards keep their
    file names. Returns the quantization_config written.
    """

    src_dir, dst_dir = os.path.abspath(src_dir), os.path.abspath(dst_dir)
    if src_dir == dst_dir:
        raise ValueError("quantize_checkpoint: source and destination are the same directory")
    if os.path.exists(dst_dir):
        if not force:
            raise FileExistsError(f"{dst_dir} exists; pass force=True to overwrite it")
    config = read_json(os.path.join(src_dir, "config.json"), "the model's config.json")
    if config.get("quantization_config"):
        raise ValueError(f"{src_dir} is already quantized ({config['quantization_config'].get('quant_method')})")
    files = _weight_files(src_dir)
    final_dir, dst_dir = dst_dir, f"{dst_dir}.tmp-{os.getpid()}"   # written aside, renamed when complete
    shutil.rmtree(dst_dir, ignore_errors=True)
    os.makedirs(dst_dir)
    try:
        return _write_quantized(src_dir, dst_dir, final_dir, files, config, group_size, modules_to_not_convert)
    except BaseException:
        shutil.rmtree(dst_dir, ignore_errors=True)
        raise


def _write_quantized(src_dir, dst_dir, final_dir, files, config, group_size, modules_to_not_convert) -> dict:
    from safetensors.numpy import save_file

    weight_map = {}
    for fname in files:
        tensors = load_safetensors(os.path.join(src_dir, fname))
        out = {}
        for name, t in tensors.items():
            module, _, leaf = name.rpartition(".")
            if is_quantizable_linear(module) and not is_excluded(module, modules_to_not_convert):
                if leaf == "weight":
                    for k, v in pack_linear(t.astype(np.float32), group_size).items():
                        out[f"{module}.{k}"] = v
                    continue
                if leaf == "bias":
                    out[name] = t.astype(np.float16)
                    continue
            out[name] = t
        save_file(out, os.path.join(dst_dir, fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in out})
    if len(files) > 1 or os.path.exists(os.path.join(src_dir, "model.safetensors.index.json")):
        total = sum(os.path.getsize(os.path.join(dst_dir, f)) for f in files)
        with open(os.path.join(dst_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
    qcfg = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": int(group_size),
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": list(modules_to_not_convert) or None,
    }
    config["quantization_config"] = qcfg
    with open(os.path.join(dst_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    for entry in os.listdir(src_dir):
        if entry in files or entry in ("config.json", "model.safetensors.index.json"):
            continue
        if entry.endswith(".safetensors") or entry.startswith("."):
            continue
        path = os.path.join(src_dir, entry)
        if os.path.isfile(path):
            shutil.copy2(path, os.path.join(dst_dir, entry))
    replace_dir(dst_dir, final_dir)      # force=True: the old copy goes only once the new one is complete
    return qcfg
