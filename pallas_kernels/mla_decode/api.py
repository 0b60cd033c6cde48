"""mla_decode: the public op, backend choice, input validation and the output contract (docs/architecture.md §3).

Backend-facing calling convention
---------------------------------
Every backend is a module exposing

    mla_decode(q, cache, block_table, seq_lens, *, softmax_scale, causal, interpret) -> (out, lse)

called with inputs this file has already validated (`validate_inputs`) and with arrays local to one device (the
op is split over a mesh before a backend sees it; a backend never sees sharded arrays or vmap tracers):
  q            [B, Sq, H, 576] bfloat16 (float32 also reaches the xla backend with a float32 cache)
  cache        MLAKVCache (latent, rope, scale|None, static page_size)
  block_table  int32 [B, max_pages]; entry j of row b is the pool page holding tokens [j*ps, (j+1)*ps) of b.
               Only entries j < ceil(seq_lens[b] / ps) may be read. A backend must not fault on out-of-range
               entries among those (clamp the page index); the contract below turns such rows into NaN.
  seq_lens     int32 [B]; lengths past max_pages*ps must not make a backend read past the table (clamp);
               the contract below turns such rows into NaN.
  softmax_scale  Python float; causal  bool (bottom-right aligned, ignored for Sq == 1); interpret  bool
and returning out [B, Sq, H, 512] in q.dtype and lse float32 [B, H, Sq] (natural log of the sum of exp of the
scaled scores). A query that sees no key gives out 0, lse +inf. Pages and slots past a sequence's length
(and past a query's causal limit) must never contribute to a sum: they may hold NaN.

Registering a backend is one line in BACKENDS: name -> (module path, availability check). The check takes a
Target (the device and the request) and returns None when the backend can run, else the reason it cannot.
`auto` walks AUTO_ORDER for the device and picks the first backend that is registered, whose check passes and
whose module imports; it logs one INFO line (logger "pallas_kernels") naming the choice and the reason, once per
distinct choice. A backend requested by name that cannot run raises ValueError saying why and which would run.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P

from pallas_kernels.device_info import compute_capability
from pallas_kernels.mla_decode.cache import LATENT_DIM, ROPE_DIM, MLAKVCache, check_cache_dtype

logger = logging.getLogger("pallas_kernels")

QK_DIM = LATENT_DIM + ROPE_DIM  # 576: absorbed q_nope (512) | q_rope (64)


# ---- targets and availability checks ---------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Target:
  """Where and on what a call would run: what an availability check looks at."""
  platform: str                                  # "cpu" | "gpu" | "tpu" | ...
  device_kind: str                               # e.g. "NVIDIA H200", "cpu"
  compute_capability: tuple[int, int] | None     # CUDA devices only
  cache_dtype: str                               # "bfloat16" | "fp8_e4m3" | "float32"
  interpret: bool

  def describe(self) -> str:
    cc = "n/a" if self.compute_capability is None else "%d.%d" % self.compute_capability
    return (f"device {self.device_kind!r} ({self.platform}), compute capability {cc}, "
            f"cache dtype {self.cache_dtype}" + (", interpret=True" if self.interpret else ""))


def _device_target(device, cache_dtype: str, interpret: bool) -> Target:
  return Target(platform=device.platform, device_kind=device.device_kind,
                compute_capability=compute_capability(device),
                cache_dtype=cache_dtype, interpret=interpret)


def _default_device(x=None):
  """The device a call on x would run on: x's own device if it is a concrete array, else jax's default."""
  if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
    try:
      return next(iter(x.devices()))
    except Exception:  # noqa: BLE001 - a deleted or abstract array: fall back to the default device
      pass
  dev = jax.config.jax_default_device
  if dev is not None and not isinstance(dev, str):
    return dev
  return jax.devices(dev)[0] if isinstance(dev, str) else jax.devices()[0]


def cuda_cc_at_least(major: int, minor: int = 0, *, cache_dtypes=("bfloat16", "fp8_e4m3"),
                     interpret_anywhere: bool = False) -> Callable[[Target], str | None]:
  """Availability check: a CUDA device of compute capability >= major.minor and one of cache_dtypes.

  interpret_anywhere=True lets interpret=True run on any device (Pallas interpret mode).
  """
  def check(t: Target) -> str | None:
    if t.cache_dtype not in cache_dtypes:
      return f"it does not support cache dtype {t.cache_dtype} (supports {', '.join(cache_dtypes)})"
    if interpret_anywhere and t.interpret:
      return None
    if t.platform != "gpu" or t.compute_capability is None:
      extra = "; pass interpret=True to run it in Pallas interpret mode" if interpret_anywhere else ""
      return f"it needs a CUDA GPU of compute capability >= {major}.{minor}, this is {t.describe()}{extra}"
    if t.compute_capability < (major, minor):
      return f"it needs compute capability >= {major}.{minor}, this is {t.describe()}"
    return None
  return check


def _always(t: Target) -> str | None:
  del t
  return None


# name -> (module path, availability check). The Hopper backend adds one line here.
BACKENDS: dict[str, tuple[str, Callable[[Target], str | None]]] = {
    "xla": ("pallas_kernels.mla_decode.reference", _always),
    "triton": ("pallas_kernels.mla_decode.triton", cuda_cc_at_least(8, 0, interpret_anywhere=True)),
    "mosaic_sm90": ("pallas_kernels.mla_decode.mosaic_sm90", cuda_cc_at_least(9, 0, interpret_anywhere=True)),
}


def _auto_order(t: Target) -> tuple[list[str], str]:
  """Backends `auto` tries for this target, best first, and the rule that chose the list."""
  cc = t.compute_capability
  if t.platform == "gpu" and cc is not None and cc >= (9, 0):
    return ["mosaic_sm90", "triton", "xla"], f"compute capability {cc[0]}.{cc[1]} >= 9.0"
  if t.platform == "gpu" and cc is not None and cc >= (8, 0):
    return ["triton", "xla"], f"compute capability {cc[0]}.{cc[1]} is 8.x"
  return ["xla"], f"platform {t.platform} has no Pallas GPU backend"


def _import_backend(name: str):
  path, _ = BACKENDS[name]
  return importlib.import_module(path)


def backend_unavailable_reason(name: str, t: Target) -> str | None:
  """None if backend `name` can run for target t, else why not (unknown, check failed, import failed)."""
  if name not in BACKENDS:
    return "it is not registered in pallas_kernels.mla_decode.api.BACKENDS"
  reason = BACKENDS[name][1](t)
  if reason is not None:
    return reason
  try:
    _import_backend(name)
  except ImportError as e:
    return f"its module {BACKENDS[name][0]} cannot be imported ({e})"
  return None


def available_backends(cache_dtype: str = "fp8_e4m3", *, interpret: bool = False,
                       device=None) -> dict[str, str | None]:
  """{backend: None if it can run on `device` (default: jax's default device) for this cache dtype, else why}."""
  t = _device_target(device if device is not None else _default_device(), check_cache_dtype(cache_dtype),
                     interpret)
  return {name: backend_unavailable_reason(name, t) for name in BACKENDS}


_logged_choices: set[tuple[str, str]] = set()


def select_backend(requested: str, t: Target) -> str:
  """Resolves `requested` ('auto' or a name) for target t; raises ValueError if a named one cannot run."""
  if requested == "auto":
    order, rule = _auto_order(t)
    skipped = []
    for name in order:
      reason = backend_unavailable_reason(name, t)
      if reason is None:
        why = f"{rule}" + (f"; skipped {'; '.join(skipped)}" if skipped else "")
        key = (name, f"{t.describe()} | {why}")
        if key not in _logged_choices:
          _logged_choices.add(key)
          logger.info("mla_decode backend=auto chose %r: %s; %s", name, t.describe(), why)
        return name
      skipped.append(f"{name} ({reason})")
    raise ValueError(f"mla_decode: no backend can run for {t.describe()}: {'; '.join(skipped)}")
  if requested not in BACKENDS:
    raise ValueError(f"mla_decode: unknown backend {requested!r}; choose 'auto' or one of {sorted(BACKENDS)}")
  reason = backend_unavailable_reason(requested, t)
  if reason is not None:
    runnable = [n for n in BACKENDS if backend_unavailable_reason(n, t) is None]
    raise ValueError(f"mla_decode: backend {requested!r} cannot run: {reason}. Backends that would run here: "
                     f"{runnable or 'none'} (or pass backend='auto').")
  return requested


def resolve_backend(requested: str, cache_dtype: str, interpret: bool, device=None) -> tuple[str, str]:
  """(backend name, reason) that mla_decode would run for a cache of `cache_dtype` on `device` (default: jax's
  default device): resolve once up front, e.g. when an engine starts, and pass the name to every call.

  'auto' picks as mla_decode does (and logs the same INFO line); a named backend that cannot run raises
  ValueError saying why and which would run."""
  target = _device_target(device if device is not None else _default_device(), check_cache_dtype(cache_dtype),
                          bool(interpret))
  name = select_backend(requested, target)
  if requested == "auto":
    _, rule = _auto_order(target)
    return name, f"auto: {rule}; {target.describe()}"
  return name, f"requested explicitly; it can run on {target.describe()}"


# ---- validation and output contract (shared by every backend) ----------------------------------------------
def validate_inputs(q, cache: MLAKVCache, block_table, seq_lens, *, softmax_scale, causal, q_rope=None) -> None:
  """Raises ValueError (what is wrong and what is expected) unless the inputs satisfy docs/architecture.md §3."""
  if not isinstance(cache, MLAKVCache):
    raise ValueError(f"cache must be a pallas_kernels.MLAKVCache, got {type(cache).__name__}")
  cache.validate()
  named = (("q", q), ("block_table", block_table), ("seq_lens", seq_lens))
  for name, x in named + ((("q_rope", q_rope),) if q_rope is not None else ()):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      raise ValueError(f"{name} must be an array, got {type(x).__name__}")
  if q_rope is not None:
    if q.ndim != 4 or q.shape[-1] != LATENT_DIM:
      raise ValueError(f"with q_rope given, q must be the absorbed q_nope part [batch, q_len, heads, {LATENT_DIM}], "
                       f"got shape {q.shape}")
    if q_rope.shape != (*q.shape[:3], ROPE_DIM) or q_rope.dtype != q.dtype:
      raise ValueError(f"q_rope must be [batch, q_len, heads, {ROPE_DIM}] = {(*q.shape[:3], ROPE_DIM)} in q's dtype "
                       f"{jnp.dtype(q.dtype).name}, got {jnp.dtype(q_rope.dtype).name} {q_rope.shape}")
  elif q.ndim != 4 or q.shape[-1] != QK_DIM:
    raise ValueError(f"q must be [batch, q_len, heads, {QK_DIM}] (absorbed q_nope {LATENT_DIM} | q_rope "
                     f"{ROPE_DIM}), or its q_nope part [.., {LATENT_DIM}] with q_rope= [.., {ROPE_DIM}], got "
                     f"shape {q.shape}")
  b, sq, h, _ = q.shape
  allowed = (jnp.bfloat16, jnp.float32) if cache.dtype == "float32" else (jnp.bfloat16,)
  if jnp.dtype(q.dtype) not in [jnp.dtype(d) for d in allowed]:
    raise ValueError(f"q must be {' or '.join(jnp.dtype(d).name for d in allowed)} for a {cache.dtype} cache, "
                     f"got {jnp.dtype(q.dtype).name}")
  if sq < 1 or h < 1 or b < 1:
    raise ValueError(f"q must have batch, q_len and heads >= 1, got shape {q.shape}")
  if block_table.ndim != 2 or block_table.shape[0] != b or block_table.shape[1] < 1:
    raise ValueError(f"block_table must be int32 [batch={b}, max_pages>=1], got {block_table.shape}")
  if jnp.dtype(block_table.dtype) != jnp.int32:
    raise ValueError(f"block_table must be int32, got {jnp.dtype(block_table.dtype).name}")
  if seq_lens.shape != (b,) or jnp.dtype(seq_lens.dtype) != jnp.int32:
    raise ValueError(f"seq_lens must be int32 [batch={b}], got {jnp.dtype(seq_lens.dtype).name} "
                     f"{seq_lens.shape}")
  if isinstance(softmax_scale, jax.core.Tracer) or not isinstance(softmax_scale, (int, float, np.floating)):
    raise ValueError(f"softmax_scale must be a Python float, got {type(softmax_scale).__name__}")
  if not math.isfinite(float(softmax_scale)) or float(softmax_scale) <= 0:
    raise ValueError(f"softmax_scale must be finite and > 0, got {softmax_scale}")
  if not isinstance(causal, (bool, np.bool_)):
    raise ValueError(f"causal must be a bool, got {causal!r}")
  # Concrete lengths can be checked now; under jit, bad rows come back as NaN (see apply_output_contract).
  if not isinstance(seq_lens, jax.core.Tracer):
    lens = np.asarray(seq_lens)
    cap = block_table.shape[1] * cache.page_size
    if lens.size and (lens.min() < 0 or lens.max() > cap):
      raise ValueError(f"seq_lens must lie in [0, max_pages * page_size = {cap}], got min {lens.min()} "
                       f"max {lens.max()}")


def apply_output_contract(out, lse, cache: MLAKVCache, block_table, seq_lens):
  """Output rules every backend shares, applied after it runs (cheap elementwise XLA).

  - length-0 sequence: out 0, lse +inf;
  - invalid row (length < 0 or > max_pages * page_size, or a page index the sequence uses outside
    [0, num_pages)): out NaN, lse NaN — loud, since under jit it cannot raise.
  """
  lens = seq_lens.astype(jnp.int32)
  ps, max_pages = cache.page_size, block_table.shape[1]
  used = jnp.arange(max_pages, dtype=jnp.int32)[None, :] < (lens[:, None] + ps - 1) // ps
  bad_page = used & ((block_table < 0) | (block_table >= cache.num_pages))
  bad = (lens < 0) | (lens > max_pages * ps) | jnp.any(bad_page, axis=1)          # [B]
  empty = lens == 0
  out = jnp.where(empty[:, None, None, None], jnp.zeros((), out.dtype), out)
  out = jnp.where(bad[:, None, None, None], jnp.full((), jnp.nan, out.dtype), out)
  lse = jnp.where(empty[:, None, None], jnp.inf, lse)
  lse = jnp.where(bad[:, None, None], jnp.nan, lse)
  return out, lse


# ---- the op: custom_partitioning (sharding) inside custom_vmap (vmap) ---------------------------------------
def _mesh_axes_size(mesh, axes) -> int:
  if axes is None:
    return 1
  axes = axes if isinstance(axes, tuple) else (axes,)
  return math.prod(mesh.shape[a] for a in axes)


def _split_axes(mesh, q_shape, q_spec):
  """Mesh axes of q's batch and head dims that the kernel can run split over (None = replicated).

  Uneven splits would hand the kernel padded rows with garbage lengths and page indices: replicate instead.
  """
  b_axes, h_axes = q_spec[0], q_spec[2]
  if q_shape[0] % _mesh_axes_size(mesh, b_axes):
    b_axes = None
  if q_shape[2] % _mesh_axes_size(mesh, h_axes):
    h_axes = None
  return b_axes, h_axes


def _explicit_mesh(arrays):
  """The mesh if any argument's type is sharded over Explicit mesh axes, else None."""
  for x in arrays:
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is not None and not mesh.empty and any(
        t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
      return mesh
  return None


@functools.lru_cache(maxsize=None)
def _make_op(backend: str, softmax_scale: float, causal: bool, interpret: bool, page_size: int,
             has_scale: bool, schedule_ndims: tuple[int, ...] = (), split_q: bool = False):
  """Builds the jittable op for one static configuration: fn(q, [q_rope], latent, rope, [scale], table, lens,
  *schedule) (schedule_ndims: ranks of a precomputed schedule's arrays, () = none; split_q: q comes as its q_nope
  part and q_rope)."""
  impl = _import_backend(backend).mla_decode
  n_sched = len(schedule_ndims)
  n_q = 2 if split_q else 1

  def run_local(*arrays):
    if n_sched:
      arrays, schedule = arrays[:-n_sched], tuple(arrays[-n_sched:])
    (q, *q_rope), (latent, rope, *rest) = arrays[:n_q], arrays[n_q:]
    scale = rest.pop(0) if has_scale else None
    block_table, seq_lens = rest
    cache = MLAKVCache(latent=latent, rope=rope, scale=scale, page_size=page_size)
    extra = dict(schedule=schedule) if n_sched else {}
    if q_rope and backend == "mosaic_sm90":
      extra["q_rope"] = q_rope[0]           # its kernels read the two parts where they are
    elif q_rope:
      q = jnp.concatenate([q, q_rope[0]], axis=-1)
    out, lse = impl(q, cache, block_table, seq_lens, softmax_scale=softmax_scale, causal=causal,
                    interpret=interpret, **extra)
    return apply_output_contract(out, lse, cache, block_table, seq_lens)

  # Sharding: batch (q, block_table, seq_lens, out, lse) and heads (q, out, lse) may be split over mesh axes;
  # everything else is replicated for the kernel (a page-sharded cache is all-gathered: correct, not fast).
  cache_rule = "p t l, p t r, p t g" if has_scale else "p t l, p t r"
  sched_rule = "".join(", " + " ".join(f"x{k}y{j}" for j in range(nd)) for k, nd in enumerate(schedule_ndims))
  q_rule = "b s h d, b s h e" if split_q else "b s h d"
  rule = f"{q_rule}, {cache_rule}, b n, b{sched_rule} -> b s h v, b h s"
  n_cache = 3 if has_scale else 2

  def partition(mesh, arg_shapes, result_shape):
    del result_shape
    q_shape = arg_shapes[0]
    spec = tuple(getattr(q_shape.sharding, "spec", P()))
    b_axes, h_axes = _split_axes(mesh, q_shape.shape, spec + (None,) * (4 - len(spec)))
    if n_sched and b_axes is not None:
      raise ValueError("mla_decode: a precomputed schedule covers the whole batch, but the batch is split over "
                       f"mesh axes {b_axes}; compute the schedule per device (inside shard_map) or pass "
                       "schedule=None")
    ns = functools.partial(NamedSharding, mesh)
    arg_shardings = (*[ns(P(b_axes, None, h_axes, None))] * n_q, *[ns(P())] * n_cache, ns(P(b_axes, None)),
                     ns(P(b_axes)), *[ns(P())] * n_sched)
    out_shardings = (ns(P(b_axes, None, h_axes, None)), ns(P(b_axes, h_axes, None)))
    return mesh, run_local, out_shardings, arg_shardings

  op = custom_partitioning(run_local)
  # Shardy wants these in order of first appearance in the rule.
  replicated = tuple(f for f in dict.fromkeys(rule.replace(",", " ").replace("->", " ").split())
                     if f not in ("b", "h"))
  op.def_partition(partition=partition, sharding_rule=rule, need_replication_factors=replicated)

  def explicit_op(mesh, *arrays):
    # Meshes with Explicit axes carry shardings in the types, where custom_partitioning's global trace cannot
    # gather from a replicated pool with batch-sharded indices; read the split from the types and shard_map.
    q_spec = tuple(jax.typeof(arrays[0]).sharding.spec)
    b_axes, h_axes = _split_axes(mesh, arrays[0].shape, q_spec + (None,) * (4 - len(q_spec)))
    if n_sched and b_axes is not None:
      raise ValueError("mla_decode: a precomputed schedule covers the whole batch, but the batch is split over "
                       f"mesh axes {b_axes}; compute it per device (inside shard_map) or pass schedule=None")
    in_specs = (*[P(b_axes, None, h_axes, None)] * n_q, *[P()] * n_cache, P(b_axes, None), P(b_axes),
                *[P()] * n_sched)
    out_specs = (P(b_axes, None, h_axes, None), P(b_axes, h_axes, None))
    arrays = [jax.sharding.reshard(x, NamedSharding(mesh, spec)) for x, spec in zip(arrays, in_specs)]
    return jax.shard_map(run_local, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=False)(*arrays)

  @jax.custom_batching.custom_vmap
  def batched_op(*arrays):
    mesh = _explicit_mesh(arrays)
    if mesh is not None:
      return explicit_op(mesh, *arrays)
    if jax.make_jaxpr(run_local)(*[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in arrays]).effects:
      # custom_partitioning cannot carry effects (Mosaic GPU interpret mode's ordered host callbacks):
      # such a computation runs unpartitioned, as one program.
      return run_local(*arrays)
    return op(*arrays)

  @batched_op.def_vmap
  def _vmap_rule(axis_size, in_batched, *arrays):
    # Fold the vmapped axis into the batch: V calls of batch B become one call of batch V*B. A vmapped cache
    # becomes one pool of V*P pages, with each copy's block table offset by v*P.
    if n_sched:
      raise ValueError("mla_decode: vmap with a precomputed schedule is not supported (the schedule describes one "
                       "batch); pass schedule=None under vmap")
    qs, (latent, rope, *rest) = arrays[:n_q], arrays[n_q:]
    qs_b, (lat_b, rope_b, *rest_b) = in_batched[:n_q], in_batched[n_q:]
    v = axis_size

    def bcast(x, batched):
      return x if batched else jnp.broadcast_to(x, (v, *x.shape))

    def fold(x):
      return x.reshape(v * x.shape[1], *x.shape[2:])

    cache_arrays = [latent, rope] + rest[:n_cache - 2]
    cache_batched = [lat_b, rope_b] + rest_b[:n_cache - 2]
    block_table, seq_lens = rest[n_cache - 2:]
    bt_b, sl_b = rest_b[n_cache - 2:]
    b = qs[0].shape[1] if qs_b[0] else qs[0].shape[0]
    q_f = [fold(bcast(x, xb)) for x, xb in zip(qs, qs_b)]
    block_table = bcast(block_table, bt_b)
    if any(cache_batched):
      num_pages = (latent.shape[1] if lat_b else latent.shape[0])
      cache_arrays = [fold(bcast(x, xb)) for x, xb in zip(cache_arrays, cache_batched)]
      offs = (jnp.arange(v, dtype=jnp.int32) * num_pages)[:, None, None]
      in_range = (block_table >= 0) & (block_table < num_pages)
      block_table = jnp.where(in_range, block_table + offs, -1)   # out-of-range stays out of range
    block_table = fold(block_table)
    seq_lens = fold(bcast(seq_lens, sl_b))
    out, lse = batched_op(*q_f, *cache_arrays, block_table, seq_lens)
    return (out.reshape(v, b, *out.shape[1:]), lse.reshape(v, b, *lse.shape[1:])), (True, True)

  # jit: an eager call compiles once as a whole (inside an outer jit this inlines).
  return jax.jit(batched_op)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SplitKVSchedule:
  """A backend's split-KV schedule for one decode step (mla_decode_schedule): device arrays plus the call shape
  it was made for, which mla_decode checks."""
  arrays: tuple[jax.Array, ...]
  backend: str = dataclasses.field(metadata=dict(static=True))
  batch: int = dataclasses.field(metadata=dict(static=True))
  rows: int = dataclasses.field(metadata=dict(static=True))          # Sq * H
  max_pages: int = dataclasses.field(metadata=dict(static=True))
  cache_dtype: str = dataclasses.field(metadata=dict(static=True))


def mla_decode_schedule(seq_lens: jax.Array, block_table: jax.Array, *, num_heads: int, q_len: int = 1,
                        cache_dtype: str, backend: str = "auto", interpret: bool = False
                        ) -> SplitKVSchedule | None:
  """The split-KV schedule mla_decode would compute for these lengths and shapes, computed once so every layer of
  a decode step can share it (FlashMLA's get_mla_metadata): pass it as mla_decode(..., schedule=...). None for a
  backend whose split does not depend on the lengths (xla: no split; triton: an even split per sequence)."""
  name = select_backend(backend, _device_target(_default_device(seq_lens), check_cache_dtype(cache_dtype),
                                                bool(interpret)))
  if name != "mosaic_sm90":
    return None
  rows = int(q_len) * int(num_heads)
  arrays = _import_backend(name).make_schedule(seq_lens, block_table.shape[1], rows=rows,
                                               fp8=cache_dtype == "fp8_e4m3", interpret=bool(interpret))
  return SplitKVSchedule(tuple(arrays), name, seq_lens.shape[0], rows, block_table.shape[1], cache_dtype)


def _check_schedule(schedule, backend: str, q, cache: MLAKVCache, block_table) -> None:
  b, sq, h, _ = q.shape
  if not isinstance(schedule, SplitKVSchedule):
    raise ValueError(f"schedule must come from pallas_kernels.mla_decode_schedule, got {type(schedule).__name__}")
  want = (backend, b, sq * h, block_table.shape[1], cache.dtype)
  got = (schedule.backend, schedule.batch, schedule.rows, schedule.max_pages, schedule.cache_dtype)
  if got != want:
    raise ValueError(f"mla_decode: the schedule was made for (backend, batch, Sq*H, max_pages, cache dtype) = "
                     f"{got}, this call is {want}; compute it with mla_decode_schedule for these arguments")


def mla_decode(q: jax.Array, cache: MLAKVCache, block_table: jax.Array, seq_lens: jax.Array, *,
               softmax_scale: float, causal: bool = False, backend: str = "auto",
               interpret: bool = False, schedule: SplitKVSchedule | None = None,
               q_rope: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """MLA decode attention over a paged latent cache (FlashMLA semantics, docs/architecture.md §3).

  q [B, Sq, H, 576] bf16 (absorbed q_nope 512 | q_rope 64); cache MLAKVCache; block_table int32 [B, max_pages];
  seq_lens int32 [B]. Returns out [B, Sq, H, 512] (q.dtype) and lse float32 [B, H, Sq], the natural log of
  sum(exp(softmax_scale * q.k)). causal with Sq > 1 is bottom-right aligned: query i sees keys [0, L - Sq + i].
  A length-0 sequence gives out 0, lse +inf. Works under jit, vmap (any argument) and with NamedSharding'd
  inputs (batch and/or heads split over a mesh) without shard_map.
  backend: "auto" | "mosaic_sm90" | "triton" | "xla"; interpret=True runs Pallas kernels in interpret mode.
  schedule: mla_decode_schedule's result for these lengths and shapes, shared by the layers of a step (None:
  computed inside, the same values). The results are identical either way.
  q_rope: q's two parts apart, q [B, Sq, H, 512] (absorbed q_nope) and q_rope [B, Sq, H, 64]: the same result as
  passing their concatenation, without writing it (a model that computes them apart passes them so).
  """
  validate_inputs(q, cache, block_table, seq_lens, softmax_scale=softmax_scale, causal=causal, q_rope=q_rope)
  target = _device_target(_default_device(q), cache.dtype, bool(interpret))
  name = select_backend(backend, target)
  sched_arrays = ()
  if schedule is not None:
    _check_schedule(schedule, name, q, cache, block_table)
    sched_arrays = schedule.arrays
  op = _make_op(name, float(softmax_scale), bool(causal), bool(interpret), cache.page_size,
                cache.scale is not None, tuple(x.ndim for x in sched_arrays), q_rope is not None)
  arrays = [cache.latent, cache.rope] + ([cache.scale] if cache.scale is not None else [])
  qs = (q,) if q_rope is None else (q, q_rope)
  return op(*qs, *arrays, block_table, seq_lens, *sched_arrays)
