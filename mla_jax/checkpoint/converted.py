"""The converted checkpoint format: our parameter layout in orbax, plus a manifest that is checked at load.

    DST/
      config.json, tokenizer files, ...   copied from the HF source unchanged (quantization_config included)
      manifest.json                       {"format": "mla_jax.converted", "version": 3, "storage_dtype", "groups",
                                           "tensors": {name: {"group", "shape", "dtype", "crc32"}}}
      weights/<group>/                    one orbax PyTree checkpoint per group: "model" (embeddings, final norm,
                                          lm_head) and "layers.<i>" per decoder layer; keys are the names below

A tensor's name is its NNX parameter path joined by dots, e.g. "layers.3.self_attn.q_a_proj.kernel" or
"layers.3.mlp.experts.w13_packed"; its value is exactly what the model holds (kernels [in, out], stacked
experts [E, ...], AWQ weights in the packed w4a16 layout: int32 words, uint8 zeros, fp16 scales), so loading is
a read and a device_put: no transposes, no AWQ repacking, no expert stacking. (int4 arrays, which no model
parameter uses today, would be stored two per byte: uint8, low nibble first, as XLA holds int4.) Floating-point
parameters that follow the model dtype are stored in the source checkpoint's dtype (the widest float dtype
among them, so nothing is rounded) and cast at load, exactly as the HF loader casts; fixed-dtype parameters
(fp32 router, AWQ) are stored as held. Per-layer groups keep the converter's host memory at one layer and let a
loader stream.

Versions: 3 holds the AWQ words in the packed layout's version 3 order (pallas_kernels/w4a16/layout.py). Version 2
directories (the layout's version 2 word order) still load: their int32 word arrays are repacked at load, a
transpose of 16-bit halves per pair of word rows (`layout.swap_word_halves`), on the host or on the devices; re-run
scripts/convert.py to skip that pass. Version 1 directories (AWQ as unpacked int4) must be re-converted.

`load_converted` checks names, shapes and dtypes against both the manifest and the model built from config.json,
and (by default) each tensor's crc32, raising an error that names the bad tensor.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from mla_jax.checkpoint.errors import RECONVERT, CheckpointError, read_json, restoring
from mla_jax.checkpoint.files import replace_dir
from mla_jax.checkpoint.hf import hf_param_map, load_hf_weights, read_tensor_index, resolve_dtype
from mla_jax.config import ModelConfig
from mla_jax.model.transformer import DeepseekV3
from pallas_kernels.w4a16 import layout

logger = logging.getLogger(__name__)

FORMAT = "mla_jax.converted"
VERSION = 3   # 3: AWQ words in the w4a16 layout's version 3 order (2: version 2 order, repacked at load;
              # 1: unpacked int4, re-convert)
_REPACK_VERSIONS = (2,)   # versions whose AWQ word arrays load through layout.swap_word_halves
MANIFEST = "manifest.json"
WEIGHTS = "weights"
# int4 tensors are stored as uint8 [..., n/2], element 2i in the low nibble of byte i; crc32 is of those bytes.
INT4_NIBBLES = "uint8_int4_nibbles"
# Weight files of other formats that are never copied into a converted directory.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt")
_ST_FLOATS = {"F32": np.dtype(np.float32), "BF16": np.dtype(ml_dtypes.bfloat16), "F16": np.dtype(np.float16)}


def is_converted(path) -> bool:
    """True when `path` is a directory written by `convert_checkpoint` (has a manifest of our format)."""
    mpath = os.path.join(os.fspath(path), MANIFEST)
    if not os.path.isfile(mpath):
        return False
    try:
        with open(mpath, encoding="utf-8") as f:
            return json.load(f).get("format") == FORMAT
    except (ValueError, AttributeError) as e:    # invalid JSON or UTF-8, or not an object
        raise CheckpointError(mpath, f"cannot be parsed ({e})", RECONVERT) from e


def param_name(path: tuple) -> str:
    return ".".join(str(p) for p in path)


def group_of(path: tuple) -> str:
    return f"layers.{path[1]}" if path[0] == "layers" else "model"


def crc32(arr: np.ndarray) -> int:
    """crc32 of the array's bytes in C order."""
    return zlib.crc32(np.ascontiguousarray(arr).reshape(-1).view(np.uint8)) & 0xFFFFFFFF


def pack_nibbles(a: np.ndarray) -> np.ndarray:
    """int4 [..., n] (n even) -> uint8 [..., n/2], element 2i in the low nibble of byte i (XLA's int4 order)."""
    v = a.astype(np.int8).view(np.uint8) & np.uint8(0xF)
    return np.ascontiguousarray(v[..., 0::2] | (v[..., 1::2] << np.uint8(4)))


def unpack_nibbles_host(b: np.ndarray) -> np.ndarray:
    """uint8 [..., n/2] -> int4 [..., n] on the host (the inverse of pack_nibbles)."""
    out = np.empty((*b.shape[:-1], b.shape[-1], 2), np.int8)
    out[..., 0] = (b & 0xF).astype(np.int8)
    out[..., 1] = (b >> 4).astype(np.int8)
    out ^= 8
    out -= 8                                                 # sign-extend 4-bit two's complement
    return out.reshape(*b.shape[:-1], -1).view(ml_dtypes.int4)  # int4 is one byte per element in numpy


def _abstract_params(cfg: ModelConfig, dtype) -> tuple[nnx.Module, dict[str, tuple[tuple, Any]]]:
    """The model built abstractly and {name: (path, ShapeDtypeStruct)} of every parameter, in tree order."""
    model = nnx.eval_shape(lambda: DeepseekV3(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    params = {}
    for path, var in nnx.to_flat_state(nnx.state(model)):
        params[param_name(path)] = (tuple(path), var.get_value())
    return model, params


def _variable(model: nnx.Module, path: tuple):
    obj = model
    for p in path[:-1]:
        obj = obj[p] if isinstance(p, int) else getattr(obj, p)
    return getattr(obj, path[-1])


def _storage_dtype(cfg: ModelConfig, src: str) -> np.dtype:
    """Widest float dtype among the source tensors that become model-dtype parameters."""
    targets = hf_param_map(cfg)
    found = set()
    for name, (_, _, st_dtype) in read_tensor_index(src).items():
        t = targets.get(name)
        if t is not None and t.dtype is None and t.convert is None and st_dtype in _ST_FLOATS:
            found.add(_ST_FLOATS[st_dtype])
    if not found:
        return np.dtype(np.float32)
    return np.dtype(np.result_type(*found))


def _copy_side_files(src: str, dst: str) -> list[str]:
    copied = []
    for entry in sorted(os.listdir(src)):
        p = os.path.join(src, entry)
        if (not os.path.isfile(p) or entry.startswith(".") or entry.endswith(_WEIGHT_SUFFIXES)
                or entry in ("model.safetensors.index.json", MANIFEST)):
            continue
        shutil.copy2(p, os.path.join(dst, entry))
        copied.append(entry)
    return copied


def _save_group(directory: str, tree: dict[str, np.ndarray]) -> None:
    import orbax.checkpoint as ocp

    ckpt = ocp.PyTreeCheckpointer(use_compression=False)
    ckpt.save(directory, args=ocp.args.PyTreeSave(tree))


def _restore_group(directory: str, names: list[str]) -> dict[str, np.ndarray]:
    import orbax.checkpoint as ocp

    ckpt = ocp.PyTreeCheckpointer(use_compression=False)
    args = {n: ocp.RestoreArgs(restore_type=np.ndarray) for n in names}
    return ckpt.restore(directory, args=ocp.args.PyTreeRestore(restore_args=args))


def convert_checkpoint(src, dst, *, force: bool = False, progress: bool = True) -> dict:
    """HF checkpoint directory (AWQ or not) -> converted directory (see module docstring). Returns the manifest.

    Written to a temporary sibling directory and renamed at the end; refuses to overwrite `dst` unless force."""
    from tqdm import tqdm

    src, dst = os.path.abspath(os.fspath(src)), os.path.abspath(os.fspath(dst))
    if not os.path.isfile(os.path.join(src, "config.json")):
        raise FileNotFoundError(f"{src} has no config.json; expected a Hugging Face model directory")
    if is_converted(src):
        raise ValueError(f"{src} is already a converted directory; load it directly")
    if dst == src or dst.startswith(src + os.sep):
        raise ValueError(f"destination {dst} must not be the source directory or inside it")
    if os.path.exists(dst) and not force:
        raise FileExistsError(f"{dst} already exists; pass --force (force=True) to replace it")

    cfg = ModelConfig.from_pretrained(src)
    storage = _storage_dtype(cfg, src)
    model, params = _abstract_params(cfg, storage.type)
    groups: dict[str, set[str]] = {}
    for name, (path, _) in params.items():
        groups.setdefault(group_of(path), set()).add(name)

    parent = os.path.dirname(dst)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(dst)}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(os.path.join(tmp, WEIGHTS))
    tensors: dict[str, dict] = {}
    pending: dict[str, dict[str, np.ndarray]] = {}
    bar = tqdm(total=len(params), unit="tensor", desc=f"convert {os.path.basename(src)}", disable=not progress)

    def capture(path: tuple, arr: np.ndarray):
        name, group = param_name(path), group_of(path)
        arr = np.ascontiguousarray(arr)
        entry = {"group": group, "shape": list(arr.shape), "dtype": str(arr.dtype)}
        stored = arr
        if arr.dtype == np.dtype(ml_dtypes.int4):   # tensorstore writes int4 one per byte: pack two per byte
            stored = pack_nibbles(arr)
            entry["stored_as"] = INT4_NIBBLES
        entry["crc32"] = crc32(stored)
        tensors[name] = entry
        pending.setdefault(group, {})[name] = stored
        if len(pending[group]) == len(groups[group]):
            _save_group(os.path.join(tmp, WEIGHTS, group), pending.pop(group))
        bar.update(1)
        # The loader only needs a placeholder of the right shape; the data is already on its way to disk.
        return np.broadcast_to(np.zeros((), arr.dtype), arr.shape)

    try:
        t0 = time.perf_counter()
        load_hf_weights(model, cfg, src, put=capture)
        bar.close()
        if pending:
            raise RuntimeError(f"internal: groups never completed: {sorted(pending)}")
        copied = _copy_side_files(src, tmp)
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "source": os.path.basename(src),
            "storage_dtype": str(storage),
            "quantization": cfg.quantization is not None,
            "side_files": copied,
            "groups": sorted(groups),
            "tensors": {n: tensors[n] for n in params},
        }
        with open(os.path.join(tmp, MANIFEST), "w") as f:
            json.dump(manifest, f, indent=1)
        replace_dir(tmp, dst)
        logger.info("converted %s -> %s: %d tensors in %.1fs", src, dst, len(params), time.perf_counter() - t0)
        return manifest
    except BaseException:
        bar.close()
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _check_against_manifest(manifest: dict, params: dict, model_dtype: np.dtype, path: str) -> None:
    entries = manifest.get("tensors", {})
    missing = [n for n in params if n not in entries]
    if missing:
        raise ValueError(f"converted checkpoint {path}: manifest lacks tensor {missing[0]!r} that the model "
                         f"(from config.json) needs ({len(missing)} missing); re-run scripts/convert.py")
    extra = [n for n in entries if n not in params]
    if extra:
        raise ValueError(f"converted checkpoint {path}: manifest names tensor {extra[0]!r} that the model "
                         f"(from config.json) does not have ({len(extra)} extra); config.json and weights disagree")
    for name, (_, want) in params.items():
        e = entries[name]
        if tuple(e["shape"]) != tuple(want.shape):
            raise ValueError(f"converted checkpoint {path}: tensor {name!r} has shape {tuple(e['shape'])} in the "
                             f"manifest, the model expects {tuple(want.shape)}")
        stored, held = np.dtype(e["dtype"]), np.dtype(want.dtype)
        castable = (held == model_dtype and jnp.issubdtype(stored, jnp.floating))
        if stored != held and not castable:
            raise ValueError(f"converted checkpoint {path}: tensor {name!r} is stored as {stored}, the model "
                             f"holds it as {held}")


def load_converted(path, dtype: Any = "float32", *, put: Optional[Callable[[tuple, np.ndarray], jax.Array]] = None,
                   verify_checksums: bool = True,
                   sharding_for: Optional[Callable[[tuple, tuple], jax.sharding.Sharding]] = None):
    """Converted directory -> (DeepseekV3 model, ModelConfig); same contract as `mla_jax.load_model`.

    put(param_path, host_array) places each parameter as in the HF loader (default: jax.device_put, which,
    unlike jnp.asarray, compiles nothing).
    sharding_for(param_path, shape) -> jax.sharding.Sharding, instead of put: restores every tensor straight into
    that sharding (tensorstore reads each device's slice, so no process holds a full copy of a sharded weight);
    checkpoint/sharded.py passes the plan's. Names, shapes and dtypes are checked as without it; the per-tensor
    crc32 (of whole arrays) cannot be, so verify_checksums must be False: verify a copied checkpoint once with
    load_converted(path, verify_checksums=True)."""
    if sharding_for is not None and (put is not None or verify_checksums):
        raise ValueError("load_converted: with sharding_for, pass no put and verify_checksums=False (no process "
                         "sees a whole sharded array, so its crc32 cannot be checked)")
    path = os.path.abspath(os.fspath(path))     # orbax takes absolute paths only
    manifest = read_json(os.path.join(path, MANIFEST), "the converted checkpoint's manifest.json")
    version = manifest.get("version")
    if manifest.get("format") != FORMAT or version not in (VERSION, *_REPACK_VERSIONS):
        raise ValueError(f"{path}/{MANIFEST}: format {manifest.get('format')!r} version {version!r}"
                         f" is not {FORMAT!r} version {VERSION} (or {_REPACK_VERSIONS}, repacked at load); re-run "
                         f"scripts/convert.py")
    repack = version != VERSION
    if repack:
        logger.info("%s: converted format version %s; its AWQ words are repacked to version %d at load (re-run "
                    "scripts/convert.py to skip this)", path, version, VERSION)
    cfg = ModelConfig.from_pretrained(path)
    jdtype = resolve_dtype(dtype)
    model, params = _abstract_params(cfg, jdtype)
    _check_against_manifest(manifest, params, np.dtype(jdtype), path)
    entries = manifest["tensors"]

    by_group: dict[str, list[str]] = {}
    for name in params:
        by_group.setdefault(entries[name]["group"], []).append(name)
    with ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1))) as pool:
        for group, names in by_group.items():
            gdir = os.path.join(path, WEIGHTS, group)
            if not os.path.isdir(gdir):
                raise ValueError(f"converted checkpoint {path}: weights/{group} is missing (holds tensor "
                                 f"{names[0]!r}); re-run scripts/convert.py")
            if sharding_for is None:
                _load_group(model, params, entries, gdir, names, path, put or (lambda _p, a: jax.device_put(a)),
                            pool if verify_checksums else None, repack)
            else:
                _load_group_sharded(model, params, entries, gdir, names, path, sharding_for, repack)
    return model, cfg


def _is_awq_words(name: str, dtype) -> bool:
    """The int32 word arrays of the packed w4a16 layout (AWQLinear.packed, AWQExperts.w13_packed / w2_packed)."""
    return name.rsplit(".", 1)[-1].endswith("packed") and np.dtype(dtype) == np.int32


def _load_group(model, params: dict, entries: dict, gdir: str, names: list[str], path: str,
                put: Callable[[tuple, np.ndarray], jax.Array], checksum_pool: Optional[ThreadPoolExecutor],
                repack: bool = False) -> None:
    """One group read to the host, checked against the manifest (and crc32 with a pool), unpacked and put.
    repack: AWQ words of an older word order (_REPACK_VERSIONS) go through layout.swap_word_halves after the
    checksums (which are of the stored bytes)."""
    with restoring(gdir):
        arrays = _restore_group(gdir, names)
    for name in names:
        a, e = arrays[name], entries[name]
        want_shape, want_dtype = tuple(e["shape"]), e["dtype"]
        if e.get("stored_as") == INT4_NIBBLES:
            want_shape, want_dtype = (*want_shape[:-1], want_shape[-1] // 2), "uint8"
        if tuple(a.shape) != want_shape or str(a.dtype) != want_dtype:
            raise ValueError(f"converted checkpoint {path}: tensor {name!r} on disk is {a.dtype}"
                             f"{tuple(a.shape)}, the manifest says {want_dtype}{want_shape}")
    if checksum_pool is not None:
        sums = dict(zip(names, checksum_pool.map(lambda n: crc32(arrays[n]), names)))
        for name in names:
            if sums[name] != entries[name]["crc32"]:
                raise CheckpointError(gdir, f"tensor {name!r} fails its checksum (crc32 {sums[name]:#010x}, "
                                      f"manifest {entries[name]['crc32']:#010x}): the data is corrupt or was "
                                      f"modified", RECONVERT)
    for name in names:
        p, want = params[name]
        a = arrays.pop(name)
        if entries[name].get("stored_as") == INT4_NIBBLES:
            a = unpack_nibbles_host(a)   # one pass; cheaper than a per-shape device compile
        elif a.dtype != want.dtype:
            a = a.astype(want.dtype)
        if repack and _is_awq_words(name, a.dtype):
            a = layout.swap_word_halves(a, xp=np)
        _variable(model, p).set_value(put(p, a))


def _load_group_sharded(model, params: dict, entries: dict, gdir: str, names: list[str], path: str,
                        sharding_for: Callable[[tuple, tuple], jax.sharding.Sharding], repack: bool = False) -> None:
    """One group restored by orbax straight into sharding_for's shardings; int4 unpacked and (repack) older AWQ
    word orders repacked on the devices."""
    import orbax.checkpoint as ocp

    args, stored = {}, {}
    for name in names:
        p, want = params[name]
        sharding = sharding_for(p, tuple(want.shape))
        shape, dtype = tuple(want.shape), want.dtype
        if entries[name].get("stored_as") == INT4_NIBBLES:
            # int4 [..., n] is stored as uint8 [..., n/2] (two per byte): restore the bytes with the same split
            # and unpack them on the devices
            pieces = shape[-1] // sharding.shard_shape(shape)[-1]
            shape, dtype = (*shape[:-1], shape[-1] // 2), np.dtype(np.uint8)
            if shape[-1] % pieces:
                raise ValueError(f"converted checkpoint {path}: int4 tensor {name!r} is stored two per byte "
                                 f"({shape[-1]} bytes a row), which {pieces} devices cannot split evenly; load it "
                                 "with a device count that divides that")
        stored[name] = (shape, dtype, sharding)
        args[name] = ocp.ArrayRestoreArgs(sharding=sharding, global_shape=shape, dtype=dtype)
    with restoring(gdir):
        arrays = ocp.PyTreeCheckpointer().restore(gdir, args=ocp.args.PyTreeRestore(restore_args=args))
    for name in names:
        p, want = params[name]
        a = arrays.pop(name)
        shape, dtype, sharding = stored[name]
        if tuple(a.shape) != shape or a.dtype != dtype:
            raise ValueError(f"converted checkpoint {path}: tensor {name!r} restored as {a.dtype}"
                             f"{tuple(a.shape)}, expected {dtype}{shape}")
        if dtype != want.dtype:
            a = jax.jit(_unpack_nibbles, out_shardings=sharding)(a)
        if repack and _is_awq_words(name, a.dtype):
            # pairs of word rows never straddle devices: a row split of the layout is whole 256-row chunks
            a = jax.jit(layout.swap_word_halves, out_shardings=sharding)(a)
        _variable(model, p).set_value(a)


def _unpack_nibbles(b: jax.Array) -> jax.Array:
    """uint8 [..., n/2] -> int4 [..., n] on the devices: element 2i is the low nibble of byte i, by arithmetic, so
    the result does not depend on how a backend lays int4 out in memory."""
    lo, hi = (b & 0xF).astype(jnp.int8), (b >> 4).astype(jnp.int8)
    v = jnp.stack([lo, hi], axis=-1).reshape(*b.shape[:-1], -1)
    return ((v ^ 8) - 8).astype(jnp.int4)                      # sign-extend the 4-bit two's complement
