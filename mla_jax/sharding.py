"""Running the model over several devices: the mesh, partition rules for every weight and cache array, and the
shard_map islands where a Pallas kernel or the expert dispatch must see per-device pieces
(docs/architecture.md §7, §9).

One mesh axis, `AXIS`, spans all devices (of all processes). Two attention modes share it:

- tensor parallel (TP, vLLM's TP8): attention heads are split over devices. q_b_proj / q_proj / kv_b_proj
  columns and o_proj rows are split by head, the absorbed W_UK / W_UV by head; tokens and the latent KV cache are
  replicated, so every device writes the same latent and its mla_decode sees H/N heads of every sequence.
- data-parallel attention (SGLang / tpu-inference style): decode-batch rows and their cache pages are split over
  devices and every device holds all heads (attention weights replicated). Device d owns batch rows
  [d·B/N, (d+1)·B/N) and global pages [d·P/N, (d+1)·P/N); its mla_decode sees its own sequences with all heads.
  Cache capacity grows with the device count.

In both modes the routed experts are split over devices (expert parallel: device d holds experts
[d·E/N, (d+1)·E/N)), and dense MLPs, shared experts, embeddings and lm_head are tensor parallel.

Everything outside the islands runs under `jax.jit` with the parameters placed by `ShardingPlan.place`; XLA's
SPMD partitioner derives the collectives from the parameter shardings plus the few explicit token-layout
constraints in `ShardingPlan.tokens` / `ShardingPlan.replicated`.

The islands (`mla_decode`, `write_cache`, `experts`) run their body under `jax.shard_map(..., check_vma=False)`
(Pallas kernels on sharded arrays outside shard_map raise; docs/architecture.md §9).

This module knows the model only by its parameter paths and the small `MixtureOfExperts` protocol; of mla_jax it
imports only mla_jax.expert_parallel (the two dispatch paths of the `experts` island). Loading a checkpoint onto
a plan is mla_jax/checkpoint/sharded.py; the engine's page pools for data-parallel attention and its memory
accounting are mla_jax/engine/pools.py and memory.py.
"""
from __future__ import annotations

import dataclasses
import enum
import logging
import math
import re
from typing import Any, Callable, Optional, Protocol, Sequence, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

import pallas_kernels
from mla_jax import expert_parallel

logger = logging.getLogger(__name__)

AXIS = "devices"
"""Name of the single mesh axis (over every device of every process)."""


# ---------------------------------------------------------------------------------------------------------------
# Mesh and multi-process start-up
# ---------------------------------------------------------------------------------------------------------------

def make_mesh(num_devices: Optional[int] = None, devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
    """A 1-D mesh named `AXIS` over `num_devices` devices (default: all devices of all processes).

    The axis type is Auto: the model code is plain jnp and XLA's SPMD partitioner propagates the parameter
    shardings through it."""
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices) if num_devices is None else int(num_devices)
    if n < 1:
        raise ValueError(f"the number of devices must be >= 1, got {num_devices}")
    if n > len(devices):
        raise ValueError(f"asked for {n} devices but only {len(devices)} are visible "
                         f"({devices[0].platform}); use at most {len(devices)} or start more processes "
                         "(see mla_jax.sharding.initialize_distributed)")
    if jax.process_count() > 1 and n != len(devices):
        raise ValueError(f"with {jax.process_count()} processes the mesh must span all {len(devices)} devices "
                         f"(asked for {n}): every process must own a part of it")
    return jax.make_mesh((n,), (AXIS,), axis_types=(AxisType.Auto,), devices=devices[:n])


def initialize_distributed(coordinator_address: str, num_processes: int, process_id: int,
                           local_device_ids: Optional[Sequence[int]] = None) -> None:
    """jax.distributed.initialize for a run spread over processes (one per host, or several on one host).

    Call it before anything touches a jax device. On CPU, cross-process collectives need the gloo
    implementation, which this selects."""
    if num_processes < 1 or not (0 <= process_id < num_processes):
        raise ValueError(f"need 0 <= process_id < num_processes, got process_id={process_id}, "
                         f"num_processes={num_processes}")
    platforms = str(jax.config.jax_platforms or "")
    if platforms.startswith("cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id, local_device_ids=local_device_ids)
    logger.info("jax.distributed: process %d of %d, %d local / %d global devices", jax.process_index(),
                jax.process_count(), jax.local_device_count(), jax.device_count())


# ---------------------------------------------------------------------------------------------------------------
# Partition rules
# ---------------------------------------------------------------------------------------------------------------

class Layout(enum.Enum):
    """How one parameter array is laid out over the mesh axis."""
    REPLICATED = "replicated"
    COLUMN = "column"      # output features split: the last axis ([in, out] kernels, AWQ qweight/qzeros/scales, bias)
    ROW = "row"            # input features split: the first axis of 2-D arrays; 1-D arrays (a bias) replicated
    EXPERTS = "experts"    # the leading expert axis of stacked expert weights
    HEADS = "heads"        # the leading head axis of absorbed W_UK [H, nope, kv_lora] / W_UV [H, v, kv_lora]
    HIDDEN = "hidden"      # embedding table [V, D]: the hidden axis


# (regex searched in the parameter path, layout with TP attention, layout with data-parallel attention).
# Paths are the module attribute names joined by "/" (e.g. "layers/3/self_attn/q_b_proj/kernel"). The first
# rule that matches wins; a parameter that matches none is an error, so every new weight gets a rule here.
PARTITION_RULES: tuple[tuple[str, Layout, Layout], ...] = (
    (r"^embed_tokens/", Layout.HIDDEN, Layout.HIDDEN),
    (r"(^|/)(input_layernorm|post_attention_layernorm)/", Layout.REPLICATED, Layout.REPLICATED),
    (r"/self_attn/(q_a_proj|q_a_layernorm|kv_a_proj_with_mqa|kv_a_layernorm)/", Layout.REPLICATED,
     Layout.REPLICATED),
    (r"/self_attn/(q_b_proj|q_proj|kv_b_proj)/", Layout.COLUMN, Layout.REPLICATED),
    (r"/self_attn/o_proj/", Layout.ROW, Layout.REPLICATED),
    (r"(^|/)(w_uk|w_uv)(/|$)", Layout.HEADS, Layout.REPLICATED),
    (r"/mlp/experts/", Layout.EXPERTS, Layout.EXPERTS),
    (r"/mlp/gate/", Layout.REPLICATED, Layout.REPLICATED),                 # router kernel [D, E] + bias [E]
    (r"/mlp/(shared_experts/)?(gate_proj|up_proj)/", Layout.COLUMN, Layout.COLUMN),
    (r"/mlp/(shared_experts/)?down_proj/", Layout.ROW, Layout.ROW),
    (r"^norm/", Layout.REPLICATED, Layout.REPLICATED),
    (r"^lm_head/", Layout.COLUMN, Layout.COLUMN),
)
_COMPILED_RULES = tuple((re.compile(rx), tp, dp) for rx, tp, dp in PARTITION_RULES)


def path_str(keypath: Sequence[Any]) -> str:
    """'layers/3/self_attn/q_b_proj/kernel' from a jax key path or a tuple of names (nnx's `.value` dropped)."""
    parts = []
    for k in keypath:
        if isinstance(k, jax.tree_util.DictKey):
            k = k.key
        elif isinstance(k, jax.tree_util.GetAttrKey):
            k = k.name
        elif isinstance(k, jax.tree_util.SequenceKey):
            k = k.idx
        elif isinstance(k, jax.tree_util.FlattenedIndexKey):
            k = k.key
        parts.append(str(k))
    while parts and parts[-1] in ("value", "raw_value"):
        parts.pop()
    return "/".join(parts)


def layout_for(path: str, data_parallel_attention: bool) -> Layout:
    for rx, tp, dp in _COMPILED_RULES:
        if rx.search(path):
            return dp if data_parallel_attention else tp
    raise ValueError(f"no partition rule for parameter {path!r}; add one to mla_jax.sharding.PARTITION_RULES "
                     "(every weight must say how it is split over devices)")


def _split_axis(layout: Layout, ndim: int) -> Optional[int]:
    """The array axis that `layout` splits, or None (replicated)."""
    if layout is Layout.REPLICATED or ndim == 0:
        return None
    if layout is Layout.COLUMN:
        return ndim - 1
    if layout is Layout.ROW:
        return 0 if ndim >= 2 else None
    if layout in (Layout.EXPERTS, Layout.HEADS):
        return 0
    if layout is Layout.HIDDEN:
        return ndim - 1 if ndim >= 2 else None
    raise AssertionError(layout)


def spec_for(path: str, shape: Sequence[int], num_devices: int, data_parallel_attention: bool) -> P:
    """PartitionSpec of parameter `path` of `shape`; raises ValueError when the split axis does not divide."""
    layout = layout_for(path, data_parallel_attention)
    axis = _split_axis(layout, len(shape))
    if axis is None or num_devices == 1:
        return P()
    size = shape[axis]
    if size % num_devices:
        what = {Layout.COLUMN: "output features", Layout.ROW: "input features (or quantization groups)",
                Layout.EXPERTS: "experts", Layout.HEADS: "heads", Layout.HIDDEN: "hidden size"}[layout]
        raise ValueError(
            f"cannot split parameter {path!r} of shape {tuple(shape)} over {num_devices} devices "
            f"({layout.value}-parallel): axis {axis} ({what}) has size {size}, which {num_devices} does not "
            f"divide. Use a device count that divides {size} (one of {_divisors(size)}).")
    return P(*([None] * axis), AXIS)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_config(cfg, num_devices: int, data_parallel_attention: bool) -> None:
    """Clear errors for model sizes the device count cannot split (before anything is loaded)."""
    if num_devices < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {num_devices}")
    if num_devices == 1:
        return
    heads = cfg.num_attention_heads
    if not data_parallel_attention and heads % num_devices:
        raise ValueError(
            f"tensor_parallel_size={num_devices} does not divide num_attention_heads={heads}: tensor-parallel "
            f"attention gives every device the same number of heads. Use one of {_divisors(heads)}, or "
            "data_parallel_attention=True (all heads on every device, sequences split instead).")
    experts = cfg.n_routed_experts
    if experts and experts % num_devices:
        raise ValueError(
            f"tensor_parallel_size={num_devices} does not divide n_routed_experts={experts}: expert parallelism "
            f"gives every device the same number of experts. Use one of {_divisors(experts)}.")


# ---------------------------------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------------------------------

@runtime_checkable
class MixtureOfExperts(Protocol):
    """What `ShardingPlan.mlp` needs of a mixture-of-experts block (mla_jax.model.moe.MoE) to run its routed
    experts expert-parallel: route(x [T, D]) -> (topk_idx [T, K], topk_w [T, K]); experts, called as
    experts(x, topk_idx, topk_w) and stacked on a leading expert axis, whose `padding_expert_index` names the
    index for pairs a device must not compute; shared_experts (a dense MLP, or None)."""
    experts: Any
    shared_experts: Any

    def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array]: ...



def _cache_page_axis(ndim: int) -> int:
    """Cache arrays end in [pages, page_size, features] (a stacked cache has leading layer axes)."""
    if ndim < 3:
        raise ValueError(f"a KV-cache array has >= 3 axes [..., pages, page_size, features], got ndim={ndim}")
    return ndim - 3


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    """Where every array of a run lives, and the shard_map islands that need per-device views.

    mesh: 1-D mesh (axis `AXIS`); data_parallel_attention: see the module docstring; expert_dispatch and
    expert_capacity_factor: how routed experts reach their devices (mla_jax.expert_parallel).
    """
    mesh: Mesh
    data_parallel_attention: bool = False
    expert_dispatch: str = "all_gather"                  # mla_jax.expert_parallel.DISPATCHES
    expert_capacity_factor: Optional[float] = None       # all_to_all rows per peer / own rows (None: 1.0)

    @classmethod
    def create(cls, cfg, tensor_parallel_size: int = 1, data_parallel_attention: bool = False,
               devices: Optional[Sequence[jax.Device]] = None, expert_dispatch: str = "all_gather",
               expert_capacity_factor: Optional[float] = None) -> "ShardingPlan":
        check_config(cfg, tensor_parallel_size, data_parallel_attention)
        expert_parallel.check_dispatch(expert_dispatch, expert_capacity_factor)
        plan = cls(make_mesh(tensor_parallel_size, devices), bool(data_parallel_attention), expert_dispatch,
                   expert_capacity_factor)
        logger.info("sharding: %d device(s), attention %s, experts split %s (%s dispatch)", plan.num_devices,
                    "data-parallel (sequences and cache pages split)" if plan.data_parallel_attention
                    else "tensor-parallel (heads split, cache replicated)",
                    "over devices" if cfg.n_routed_experts else "(no routed experts)", expert_dispatch)
        return plan

    # ---- basics ---------------------------------------------------------------------------------------------
    @property
    def num_devices(self) -> int:
        return self.mesh.shape[AXIS]

    def sharding(self, spec: P) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    @property
    def replicated_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    # ---- parameters -----------------------------------------------------------------------------------------
    def param_spec(self, path: str, shape: Sequence[int]) -> P:
        return spec_for(path, shape, self.num_devices, self.data_parallel_attention)

    def param_specs(self, state) -> Any:
        """PartitionSpecs for a pytree of parameters (an nnx.State, abstract or concrete), same structure."""
        return jax.tree_util.tree_map_with_path(lambda kp, x: self.param_spec(path_str(kp), x.shape), state)

    def param_shardings(self, state) -> Any:
        return jax.tree.map(self.sharding, self.param_specs(state))

    def place(self, state) -> Any:
        """Moves an in-memory parameter pytree onto the mesh by the rules. Each device receives its shard only
        (device_put of a host/one-device array transfers the slices). For checkpoints, prefer the loaders,
        which never build the full array (`mla_jax.checkpoint.sharded.load_sharded`)."""
        return jax.device_put(state, self.param_shardings(state))

    def engine_weight_shardings(self, weights) -> Any:
        """Shardings for the engine's `EngineWeights(model=nnx.State, absorbed=((w_uk, w_uv), ...))` (abstract or
        concrete): the model state by the rules, the absorbed W_UK / W_UV by head (TP) or replicated (DP)."""
        absorbed = tuple(tuple(self.sharding(self.param_spec(f"absorbed/{i}/{name}", a.shape))
                               for name, a in zip(("w_uk", "w_uv"), pair))
                         for i, pair in enumerate(weights.absorbed))
        return type(weights)(self.param_shardings(weights.model), absorbed)

    def place_engine_weights(self, weights) -> Any:
        return jax.device_put(weights, self.engine_weight_shardings(weights))

    # ---- KV cache -------------------------------------------------------------------------------------------
    def cache_spec(self, ndim: int) -> P:
        """TP: replicated. DP attention: the page axis split (each device holds 1/N of the pages)."""
        axis = _cache_page_axis(ndim)
        if not self.data_parallel_attention or self.num_devices == 1:
            return P()
        return P(*([None] * axis), AXIS)

    def cache_specs(self, cache) -> Any:
        return jax.tree.map(lambda a: self.cache_spec(a.ndim), cache)

    def cache_shardings(self, cache) -> Any:
        return jax.tree.map(lambda a: self.sharding(self.cache_spec(a.ndim)), cache)

    def check_cache_size(self, num_pages: int, max_num_seqs: int) -> None:
        """With data-parallel attention pages and batch rows are split evenly; say so when they cannot be."""
        if not self.data_parallel_attention:
            return
        n = self.num_devices
        if num_pages % n:
            raise ValueError(f"data-parallel attention over {n} devices splits the KV cache's pages evenly: "
                             f"num_pages={num_pages} is not a multiple of {n}")
        if max_num_seqs % n:
            raise ValueError(f"data-parallel attention over {n} devices splits the batch evenly: "
                             f"max_num_seqs={max_num_seqs} is not a multiple of {n}")

    def page_owner(self, page: int, num_pages: int) -> int:
        """The device (mesh position) that holds global page `page` with data-parallel attention."""
        return page // (num_pages // self.num_devices)

    # ---- activation layout (call inside jitted step functions) -----------------------------------------------
    def decode_rows(self, x: jax.Array) -> jax.Array:
        """Constrains decode-step activations [B, ...] to the decode row layout: replicated with TP attention,
        rows split (device d: rows [d·B/N, (d+1)·B/N)) with data-parallel attention."""
        if self.num_devices == 1:
            return x
        return jax.lax.with_sharding_constraint(x, self.sharding(self.decode_row_spec))

    @property
    def decode_row_spec(self) -> P:
        return P(AXIS) if self.data_parallel_attention else P()

    def replicated(self, x):
        """Constrains arrays (a pytree) to be replicated: every device holds all of it."""
        if self.num_devices == 1:
            return x
        return jax.tree.map(lambda a: jax.lax.with_sharding_constraint(a, self.replicated_sharding), x)

    def heads(self, x: jax.Array, axis: int) -> jax.Array:
        """Constrains a per-head activation (e.g. q [N, C, H, d]) to be split over devices along its head `axis`.

        Prefill attention runs head-parallel in both modes: with TP attention that is where the weights put it
        anyway; with data-parallel attention (replicated weights, replicated prefill tokens) it keeps every
        device from computing all heads of every prompt token."""
        axis = axis % x.ndim
        if self.num_devices == 1 or x.shape[axis] % self.num_devices:
            return x             # (data-parallel attention allows head counts the devices do not divide)
        return jax.lax.with_sharding_constraint(x, self.sharding(P(*([None] * axis), AXIS)))

    def mlp(self, module, x: jax.Array, *, decode: bool) -> jax.Array:
        """`module(x)` for a decoder layer's MLP (dense `MLP` or `MoE`) with the parallel layout made explicit:
        tokens are replicated into the layer (with data-parallel attention during decode that is an all-gather
        of the devices' rows), dense MLP and shared experts run tensor-parallel, routed experts expert-parallel
        (`experts`), and the result goes back to the caller's layout (`decode`: the decode row layout, else
        replicated). Same math as module(x) (MoE.__call__: route, routed experts, + shared experts); a module is
        taken apart that way when it is a `MixtureOfExperts`."""
        if self.num_devices == 1:
            return module(x)
        rows_split = decode and self.data_parallel_attention
        back = self.decode_rows if decode else self.replicated
        x = self.replicated(x)
        if not isinstance(module, MixtureOfExperts):
            return back(module(x))
        flat = x.reshape(-1, x.shape[-1])
        topk_idx, topk_w = module.route(flat)
        out = self.experts(module.experts, flat, topk_idx, topk_w, scatter_rows=rows_split).reshape(x.shape)
        if module.shared_experts is not None:
            out = out + back(module.shared_experts(x))
        return out

    # ---- islands --------------------------------------------------------------------------------------------
    def mla_decode(self, q: jax.Array, cache, block_table: jax.Array, seq_lens: jax.Array, q_rope=None, **kwargs):
        """pallas_kernels.mla_decode on each device's part: TP — all sequences, H/N heads (q [B, Sq, H, 576]
        split on H, the replicated cache); DP attention — B/N sequences with all heads, the device's own cache
        pages (block-table entries are global page ids; each device maps them to its local pages). q_rope: q's
        rope part apart (q then its q_nope part), split as q is."""
        if self.num_devices == 1:
            return pallas_kernels.mla_decode(q, cache, block_table, seq_lens, q_rope=q_rope, **kwargs)
        qs = (q,) if q_rope is None else (q, q_rope)
        if self.data_parallel_attention:
            pages_local = _num_pages(cache) // self.num_devices

            def body(cache, block_table, seq_lens, q, q_rope=None):
                first = jax.lax.axis_index(AXIS) * pages_local
                local = block_table - first
                # Only padding entries (past a sequence's length) may name another device's page; -1 keeps a bad
                # live entry loud (mla_decode returns NaN for a used page outside the pool).
                local = jnp.where((local >= 0) & (local < pages_local), local, -1)
                return pallas_kernels.mla_decode(q, cache, local, seq_lens, q_rope=q_rope, **kwargs)

            rows = P(AXIS)
            in_specs = (self.cache_specs(cache), rows, rows, *[rows] * len(qs))
            out_specs = (rows, rows)
        else:
            def body(cache, block_table, seq_lens, q, q_rope=None):
                return pallas_kernels.mla_decode(q, cache, block_table, seq_lens, q_rope=q_rope, **kwargs)

            heads = P(None, None, AXIS)
            in_specs = (self.cache_specs(cache), P(), P(), *[heads] * len(qs))
            out_specs = (heads, P(None, AXIS))          # out [B, Sq, H, 512], lse [B, H, Sq]
        return jax.shard_map(body, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs,
                             check_vma=False)(cache, block_table, seq_lens, *qs)

    def write_cache(self, cache, slots: jax.Array, latent: jax.Array, rope: jax.Array):
        """cache.write(slots, latent, rope) with global slots (page·page_size + offset). TP: every device writes
        every token into its replicated copy (plain SPMD). DP attention: every device receives all tokens and
        writes those whose page it owns, at its local slot; the others are dropped. (Tokens need not be
        arranged by device, so prefill batches can be packed freely.)"""
        if self.num_devices == 1 or not self.data_parallel_attention:
            return cache.write(slots, latent, rope)
        pages_local = _num_pages(cache) // self.num_devices
        page_size = _page_size(cache)

        def body(cache, slots, latent, rope):
            first = jax.lax.axis_index(AXIS) * (pages_local * page_size)
            local = slots - first
            owned = (local >= 0) & (local < pages_local * page_size)
            # Out-of-range slots are dropped by the scatter (jnp .at[].set drops out-of-bounds updates).
            local = jnp.where(owned, local, pages_local * page_size)
            return cache.write(local, latent, rope)

        specs = self.cache_specs(cache)
        return jax.shard_map(body, mesh=self.mesh, in_specs=(specs, P(), P(), P()), out_specs=specs,
                             check_vma=False)(cache, slots, latent, rope)

    def read_pages(self, cache, block_table: jax.Array) -> tuple[jax.Array, jax.Array]:
        """cache.gather(block_table) -> (latent [N, P·ps, ·], rope [N, P·ps, ·]), each row's pages dequantized,
        with the rows replicated. TP: plain (the cache is replicated). DP attention: each device gathers the pages
        it owns and zeros the rest, and a sum over devices assembles every row (each page has exactly one owner).
        Used by the prefill step to read a chunk's cached prefix."""
        if self.num_devices == 1 or not self.data_parallel_attention:
            return cache.gather(block_table)
        pages_local = _num_pages(cache) // self.num_devices
        page_size = _page_size(cache)

        def body(cache, block_table):
            local = block_table - jax.lax.axis_index(AXIS) * pages_local
            owned = (local >= 0) & (local < pages_local)                        # [N, P]
            latent, rope = cache.gather(jnp.where(owned, local, 0))
            owned_tok = jnp.repeat(owned, page_size, axis=1)[..., None]         # [N, P·ps, 1]
            latent = jnp.where(owned_tok, latent, 0)
            rope = jnp.where(owned_tok, rope, 0)
            return jax.lax.psum(latent, AXIS), jax.lax.psum(rope, AXIS)

        return jax.shard_map(body, mesh=self.mesh, in_specs=(self.cache_specs(cache), P()), out_specs=(P(), P()),
                             check_vma=False)(cache, block_table)

    def caches(self, caches):
        """Constrains (per-layer) caches to the plan's cache layout, so a jitted step returns them exactly as it
        received them (one compilation, donation in place)."""
        if self.num_devices == 1:
            return caches
        return jax.lax.with_sharding_constraint(caches, self.cache_shardings(caches))

    def experts(self, experts_module, x: jax.Array, topk_idx: jax.Array, topk_w: jax.Array, *,
                scatter_rows: bool = False) -> jax.Array:
        """Expert-parallel routed experts: Σ_k w[t,k]·expert_{idx[t,k]}(x[t]) with the experts split over devices,
        by the plan's `expert_dispatch` (mla_jax.expert_parallel: "all_gather", the reference, or "all_to_all").

        x [T, D], topk_idx / topk_w [T, K], replicated. Pairs a device must not compute get the module's
        `padding_expert_index` and weight 0: for AWQExperts an out-of-range index its tiling drops (no compute;
        checked by tests/sharding_8dev_cases.py), for Experts index 0 (a wasted row, still exact). Partial outputs
        are summed in fp32. Returns [T, D] in x.dtype, replicated, or with scatter_rows split by rows (device d keeps
        rows [d·T/N, (d+1)·T/N), the decode row layout of data-parallel attention)."""
        if self.num_devices == 1:
            return experts_module(x, topk_idx, topk_w)
        if self.expert_dispatch == "all_to_all":
            return expert_parallel.experts_all_to_all(self.mesh, AXIS, experts_module, x, topk_idx, topk_w,
                                                      scatter_rows=scatter_rows,
                                                      capacity_factor=self.expert_capacity_factor)
        return expert_parallel.experts_all_gather(self.mesh, AXIS, experts_module, x, topk_idx, topk_w,
                                                  scatter_rows=scatter_rows)


class SingleDevice:
    """The operations of ShardingPlan that the engine's step functions call, for an unsharded run (plain calls).
    `ops(plan)` picks between the two, so the step functions read the same either way."""
    num_devices = 1
    data_parallel_attention = False

    @staticmethod
    def mla_decode(q, cache, block_table, seq_lens, q_rope=None, **kwargs):
        return pallas_kernels.mla_decode(q, cache, block_table, seq_lens, q_rope=q_rope, **kwargs)

    @staticmethod
    def write_cache(cache, slots, latent, rope):
        return cache.write(slots, latent, rope)

    @staticmethod
    def read_pages(cache, block_table):
        return cache.gather(block_table)

    @staticmethod
    def mlp(module, x, *, decode: bool):
        return module(x)

    @staticmethod
    def decode_rows(x):
        return x

    @staticmethod
    def heads(x, axis):
        return x

    @staticmethod
    def replicated(x):
        return x

    @staticmethod
    def caches(caches):
        return caches


SINGLE_DEVICE = SingleDevice()


def ops(plan: Optional[ShardingPlan]):
    """The plan, or the single-device pass-through when there is none."""
    return SINGLE_DEVICE if plan is None else plan


def _num_pages(cache) -> int:
    leaf = jax.tree.leaves(cache)[0]
    return leaf.shape[_cache_page_axis(leaf.ndim)]


def _page_size(cache) -> int:
    if hasattr(cache, "page_size"):
        return int(cache.page_size)
    leaf = jax.tree.leaves(cache)[0]
    return leaf.shape[leaf.ndim - 2]


# ---------------------------------------------------------------------------------------------------------------
# Bytes per device (the engine's memory accounting: mla_jax/engine/memory.py)
# ---------------------------------------------------------------------------------------------------------------

def bytes_per_device(arrays, shardings) -> int:
    """Bytes one device holds for a pytree of (abstract) arrays laid out by matching shardings."""
    total = 0
    for a, s in zip(jax.tree.leaves(arrays), jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(
            x, NamedSharding))):
        total += math.prod(s.shard_shape(a.shape)) * dtype_bits(a.dtype) // 8
    return total


def dtype_bits(dtype) -> int:
    """Storage bits per element on the device (XLA packs 4-bit types two per byte)."""
    dtype = jnp.dtype(dtype)
    if dtype.name in ("int4", "uint4", "float4_e2m1fn"):
        return 4
    return dtype.itemsize * 8


# ---------------------------------------------------------------------------------------------------------------
# Host <-> global arrays (also across processes)
# ---------------------------------------------------------------------------------------------------------------

def put_global(plan: ShardingPlan, tree, spec: P = P()):
    """Host arrays (identical in every process) -> global arrays laid out by `spec` on the plan's mesh. Each
    device receives only its slice; works with several processes, where jit refuses host (numpy) arguments."""
    sharding = plan.sharding(spec)

    def one(a):
        a = np.asarray(a)
        return jax.make_array_from_callback(a.shape, sharding, lambda idx: a[idx], dtype=a.dtype)

    return jax.tree.map(one, tree)


def fetch(x) -> np.ndarray:
    """A global array -> numpy in this process. It must be replicated (or live on this process's devices only):
    constrain step outputs the host reads with `ShardingPlan.replicated`."""
    if not (x.is_fully_replicated or x.is_fully_addressable):
        raise ValueError(f"cannot read an array sharded as {x.sharding} across processes on one host; replicate it "
                         "in the jitted step (ShardingPlan.replicated) before reading it")
    if x.is_fully_addressable:
        return np.asarray(x)
    return np.asarray(x.addressable_data(0))


def allocate_sharded(plan: ShardingPlan, allocate: Callable[[], Any]) -> Any:
    """Runs allocate() (e.g. the engine's per-layer cache allocation) under jit with the plan's cache layout as
    the output sharding, so each device creates only its part (no full copy on one device first)."""
    abstract = jax.eval_shape(allocate)
    return jax.jit(allocate, out_shardings=plan.cache_shardings(abstract))()
