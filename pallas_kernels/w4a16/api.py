"""w4a16: int4-weight x bf16-activation GEMMs, the public ops and the backend choice (docs/architecture.md §4).

  w4a16_matmul(x [M, K], weight) -> [M, N]                     dense AWQ linears
  w4a16_moe(x [T, D], topk_ids [T, K], topk_weights [T, K], w13, w2) -> [T, D]
                                                                routed experts: Σ_k w · down(silu(gate x) · up x)

Weights are `layout.W4A16Weight` (pack / pack_gate_up build them from AWQ's q, z, s). Backends:
  triton  Pallas Triton kernels (triton.py); CUDA compute capability >= 8.0, or interpret=True on any device;
          bf16 activations.
  mosaic_sm90  Pallas Mosaic GPU kernels for Hopper (mosaic_sm90.py: TMA-streamed weights, wgmma with the decoded
          weights as a register operand); CUDA compute capability 9.x, or interpret=True on any device; bf16
          activations. 1.2-1.4x faster than triton on an H200 (NOTES.md, "Hopper kernel").
  xla     dequantize-and-dot (reference.py); any device and dtype.
`auto` picks, for bf16 activations: mosaic_sm90 on a Hopper GPU (compute capability 9.x) for weights of at least
MOSAIC_MIN_WEIGHTS (K·N per expert), triton for smaller ones, on other CUDA GPUs of compute capability >= 8.0 and
in interpret mode; else xla (also for group sizes the kernels are not built for). Why the size rule: a Mosaic GPU
kernel is lowered again in every process (~0.5 s per kernel shape; the embedded 16M-parameter model spent 11.9 s
lowering per generate.py run against 2.0 s with triton, H200), which small layers never win back. It logs one
INFO line (logger "pallas_kernels") per distinct choice with its reason. A backend requested by name that cannot
run raises ValueError saying why and what would run; nothing is swapped silently.

Both ops are plain jittable functions; the MoE groups tokens by expert on the device with static shapes
(routing.py). Under a mesh, call them inside `jax.shard_map` on per-device shards (a column-split weight gives
that device's columns; a row-split weight a partial sum to psum; an expert-split stack routes the device's own
experts, other ids arriving out of range are dropped).
"""
from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp

from pallas_kernels.device_info import compute_capability
from pallas_kernels.w4a16 import layout, mosaic_sm90, reference, routing, routing_triton, triton

logger = logging.getLogger("pallas_kernels")

BACKEND_NAMES = ("auto", "triton", "xla", "mosaic_sm90")
_logged: set = set()
KERNEL_BACKENDS = {"triton": triton, "mosaic_sm90": mosaic_sm90}   # backend name -> kernel module
# K·N per expert (per device, inside a shard_map island) from which auto takes mosaic_sm90 on Hopper. DeepSeek-V3's
# smallest AWQ shard, an expert's down projection split 8 ways (2048 x 7168 / 8), has 1.8M; the embedded model's
# largest AWQ linear 0.39M.
MOSAIC_MIN_WEIGHTS = 1 << 20


def resolve_backend(requested: str, x_dtype, interpret: bool = False, device=None,
                    group_size: int | None = None, weight_elems: int | None = None) -> tuple[str, str]:
  """(backend name, reason) for a w4a16 call; raises ValueError for a request that cannot run. weight_elems: K·N
  of the (per-expert) weight, for auto's size rule (None: a large weight)."""
  if requested not in BACKEND_NAMES:
    raise ValueError(f"w4a16 backend {requested!r} is unknown; choose one of {BACKEND_NAMES}.")
  device = device or jax.devices()[0]
  cc = compute_capability(device)
  on_gpu = device.platform == "gpu" and cc is not None and cc >= (8, 0)
  where = (f"{device.device_kind} (compute capability {cc[0]}.{cc[1]})" if cc else f"{device.platform} device")
  bf16 = jnp.dtype(x_dtype) == jnp.bfloat16
  kernel_group = group_size is None or group_size in layout.KERNEL_GROUP_SIZES
  if requested == "xla":
    return "xla", "requested"
  # a kernel backend by name: the inputs both kernels need, then the device each needs
  if requested in KERNEL_BACKENDS:
    if not bf16:
      raise ValueError(f"w4a16 backend {requested!r} takes bfloat16 activations, got {jnp.dtype(x_dtype)}; cast x "
                       f"to bfloat16 or use backend='xla'.")
    if not kernel_group:
      raise ValueError(f"w4a16 backend {requested!r} is built for group sizes {layout.KERNEL_GROUP_SIZES}, got "
                       f"{group_size}; use backend='xla' for this weight.")
    if requested == "mosaic_sm90":
      hopper = device.platform == "gpu" and cc is not None and cc[0] == 9
      if not (interpret or hopper):
        raise ValueError(f"w4a16 backend 'mosaic_sm90' needs a Hopper GPU (CUDA compute capability 9.x) or "
                         f"interpret=True; this is a {where}. backend='triton' runs on compute capability >= 8.0, "
                         f"backend='xla' anywhere.")
      return "mosaic_sm90", "requested"
    if not (interpret or on_gpu):
      raise ValueError(f"w4a16 backend 'triton' needs a CUDA GPU of compute capability >= 8.0 or interpret=True; "
                       f"this is a {where}. backend='xla' runs here.")
    return "triton", "requested"
  if not bf16:
    return "xla", f"{jnp.dtype(x_dtype)} activations (the int4 kernels compute with bfloat16 activations)"
  if not kernel_group:
    return "xla", f"group size {group_size} (the kernels are built for {layout.KERNEL_GROUP_SIZES})"
  if interpret:
    return "triton", "interpret=True"
  if on_gpu and cc[0] == 9:
    if weight_elems is not None and weight_elems < MOSAIC_MIN_WEIGHTS:
      return "triton", (f"{where}: Hopper, but a small weight (K·N {weight_elems} < {MOSAIC_MIN_WEIGHTS}; "
                        "mosaic_sm90's per-process lowering does not pay)")
    return "mosaic_sm90", f"{where}: Hopper"
  if on_gpu:
    return "triton", f"{where} >= 8.0, not Hopper"
  return "xla", f"no CUDA GPU of compute capability >= 8.0 ({where})"


def _choose(requested: str, x_dtype, interpret: bool, weight: layout.W4A16Weight) -> str:
  name, reason = resolve_backend(requested, x_dtype, interpret, group_size=weight.group_size,
                                 weight_elems=weight.k * weight.n)
  if (requested, name, reason) not in _logged:
    _logged.add((requested, name, reason))
    logger.info("w4a16 backend: %s (%s)", name, reason)
  return name


def _check_x(x, k: int, what: str) -> None:
  if x.ndim != 2 or x.shape[1] != k:
    raise ValueError(f"{what}: x must be [rows, K={k}], got shape {tuple(x.shape)}.")


def w4a16_matmul(x: jax.Array, weight: layout.W4A16Weight, *, backend: str = "auto", interpret: bool = False,
                 config: dict | None = None, out_dtype=None) -> jax.Array:
  """x [M, K] @ W [K, N] -> [M, N] in out_dtype (default x.dtype; float32 accumulation either way: float32 keeps
  partial sums exact for a caller that adds them, e.g. a K split over devices)."""
  if weight.lead_shape:
    raise ValueError(f"w4a16_matmul takes one weight, got a stack of shape {weight.lead_shape}.")
  _check_x(x, weight.k, "w4a16_matmul")
  out_dtype = jnp.dtype(out_dtype or x.dtype)
  if x.shape[0] == 0:
    return jnp.zeros((0, weight.n), out_dtype)
  name = _choose(backend, x.dtype, interpret, weight)
  return _matmul(x, weight, name=name, interpret=bool(interpret), config=_frozen(config), out_dtype=out_dtype)


def _frozen(config: dict | None):
  """A kernel config as a hashable static argument (None stays None); _thawed undoes it."""
  if config is None:
    return None
  try:
    return tuple(sorted(config.items()))
  except AttributeError:
    raise ValueError(f"w4a16: config must be a dict of kernel options, got {config!r}.") from None


def _thawed(config):
  return None if config is None else dict(config)


# Each op body is its own jit: a model's layers of one shape are traced and lowered once per program instead of
# once per layer (XLA inlines the call, so the compiled program is the same). That is start-up time paid in every
# process, cache or not: on this CPU the embedded model's prefill traced its 5 MoE layers in 0.53 s.
@functools.partial(jax.jit, static_argnames=("name", "interpret", "config", "out_dtype"))
def _matmul(x, weight, *, name, interpret, config, out_dtype):
  if name == "xla":
    return reference.matmul(x, weight, out_dtype=out_dtype)
  return KERNEL_BACKENDS[name].matmul(x, weight, interpret=interpret, config=_thawed(config), out_dtype=out_dtype)


def default_block_m(num_tokens: int, top_k: int, num_experts: int, backend: str = "triton") -> int:
  """Rows per expert block: 16 for decode-sized batches (a block is mostly padding anyway), larger once an
  expert averages more rows, so prefill runs real-sized tiles. mosaic_sm90 takes 8-row blocks (wgmma N = 8) while
  an expert averages at most 2 rows: half the x tile per chunk and half the gathered padding rows (H200, MoE
  E=256 D=7168 I=2048 top-8 g64, T = 1 / 16 / 64: 97.6 / 897.4 / 1,960.6 -> 94.6 / 860.6 / 1,864.1 µs, NOTES v9)."""
  per_expert = num_tokens * top_k / max(num_experts, 1)
  if backend == "mosaic_sm90" and per_expert <= 2:
    return 8
  return 16 if per_expert <= 16 else (32 if per_expert <= 48 else 64)


def w4a16_moe(x: jax.Array, topk_ids: jax.Array, topk_weights: jax.Array, w13: layout.W4A16Weight,
              w2: layout.W4A16Weight, *, backend: str = "auto", interpret: bool = False,
              block_m: int | None = None, config: dict | None = None) -> jax.Array:
  """Σ_k topk_weights[t,k] · down_e(silu(gate_e x_t) · up_e x_t), e = topk_ids[t,k]; [T, D] -> [T, D] in x.dtype.

  w13: stacked [E] gate|up weights from `layout.pack_gate_up` ([D -> 2 I_pad]); w2: stacked [E] down [I -> D].
  Expert ids outside [0, E) contribute 0 (expert-parallel shards); a repeated expert counts once per k."""
  if w13.n % 2:
    raise ValueError(f"w4a16_moe: w13 has {w13.n} columns, not gate|up halves; build it with layout.pack_gate_up.")
  if len(w13.lead_shape) != 1 or w2.lead_shape != w13.lead_shape:
    raise ValueError(f"w4a16_moe: w13 and w2 must be stacks over the same experts [E], got {w13.lead_shape} and "
                     f"{w2.lead_shape}.")
  num_experts = w13.lead_shape[0]
  inter = w13.n // 2
  if layout.padded_n(w2.k) != inter:
    raise ValueError(f"w4a16_moe: w2 takes K={w2.k} rows but w13 gives {inter} gate/up columns per half "
                     f"(each padded to a multiple of {layout.ALIGN_N}); build w13 with layout.pack_gate_up.")
  _check_x(x, w13.k, "w4a16_moe")
  if w2.n != w13.k:
    raise ValueError(f"w4a16_moe: w2 outputs {w2.n} columns but x has {w13.k}.")
  if topk_ids.shape != topk_weights.shape or topk_ids.ndim != 2 or topk_ids.shape[0] != x.shape[0]:
    raise ValueError(f"w4a16_moe: topk_ids {tuple(topk_ids.shape)} and topk_weights "
                     f"{tuple(topk_weights.shape)} must both be [T={x.shape[0]}, top_k].")
  t, k = topk_ids.shape
  if t == 0:
    return jnp.zeros((0, w2.n), x.dtype)
  name = _choose(backend, x.dtype, interpret, w13)
  bm = block_m or default_block_m(t, k, num_experts, name)
  return _moe(x, topk_ids, topk_weights, w13, w2, name=name, interpret=bool(interpret), block_m=bm,
              config=_frozen(config))


def align(topk_ids, topk_weights, num_experts: int, block_m: int, *, interpret: bool = False) -> routing.Routing:
  """The kernels' grouping of the pairs by expert: one Pallas Triton launch (routing_triton.align_kernel) from two
  tokens up to its MAX_PAIRS pairs, else routing.align (XLA; one token takes its elementwise path there). Both give
  the same Routing to the bit."""
  t, k = topk_ids.shape
  if t > 1 and routing_triton.supports(t * k, block_m):
    return routing_triton.align_kernel(topk_ids, topk_weights, num_experts, block_m, interpret=interpret)
  return routing.align(topk_ids, topk_weights, num_experts, block_m)


@functools.partial(jax.jit, static_argnames=("name", "interpret", "block_m", "config"))
def _moe(x, topk_ids, topk_weights, w13, w2, *, name, interpret, block_m, config):
  if name == "xla":
    return reference.moe(x, topk_ids, topk_weights, w13, w2, block_m=block_m)
  num_experts = w13.lead_shape[0]
  rt = align(topk_ids, topk_weights, num_experts, block_m, interpret=interpret)
  busy = min(rt.num_blocks, num_experts, topk_ids.size)    # blocks expected in use: sizes the K split
  if name == "mosaic_sm90":
    return mosaic_sm90.moe(x, rt, w13, w2, busy_blocks=busy, interpret=interpret,
                           config=_thawed(config)).astype(x.dtype)
  rows = triton.moe(x, rt, w13, w2, busy_blocks=busy, interpret=interpret, config=_thawed(config))
  return routing.combine(rows, rt).astype(x.dtype)
