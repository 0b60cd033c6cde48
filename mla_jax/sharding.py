"""Running the model over several devices: the mesh, partition rules for every weight and cache array, and the
shard_map islands where a Pallas kernel or the expert dispatch must see per-device pieces (DESIGN.md §7, §9).

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
(Pallas kernels on sharded arrays outside shard_map raise; DESIGN §7).
"""
from __future__ import annotations

import dataclasses
import enum
import logging
import math
import re
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

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

def _cache_page_axis(ndim: int) -> int:
    """Cache arrays end in [pages, page_size, features] (a stacked cache has leading layer axes)."""
    if ndim < 3:
        raise ValueError(f"a KV-cache array has >= 3 axes [..., pages, page_size, features], got ndim={ndim}")
    return ndim - 3


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    """Where every array of a run lives, and the shard_map islands that need per-device views.

    mesh: 1-D mesh (axis `AXIS`); data_parallel_attention: see the module docstring.
    """
    mesh: Mesh
    data_parallel_attention: bool = False

    @classmethod
    def create(cls, cfg, tensor_parallel_size: int = 1, data_parallel_attention: bool = False,
               devices: Optional[Sequence[jax.Device]] = None) -> "ShardingPlan":
        check_config(cfg, tensor_parallel_size, data_parallel_attention)
        plan = cls(make_mesh(tensor_parallel_size, devices), bool(data_parallel_attention))
        logger.info("sharding: %d device(s), attention %s, experts split %s", plan.num_devices,
                    "data-parallel (sequences and cache pages split)" if plan.data_parallel_attention
                    else "tensor-parallel (heads split, cache replicated)",
                    "over devices" if cfg.n_routed_experts else "(no routed experts)")
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
        which never build the full array (`mla_jax.sharding.load_sharded`)."""
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
        replicated). Same math as module(x) (MoE.__call__: route, routed experts, + shared experts)."""
        if self.num_devices == 1:
            return module(x)
        from mla_jax.model.moe import MoE
        rows_split = decode and self.data_parallel_attention
        back = self.decode_rows if decode else self.replicated
        x = self.replicated(x)
        if not isinstance(module, MoE):
            return back(module(x))
        flat = x.reshape(-1, x.shape[-1])
        topk_idx, topk_w = module.route(flat)
        out = self.experts(module.experts, flat, topk_idx, topk_w, scatter_rows=rows_split).reshape(x.shape)
        if module.shared_experts is not None:
            out = out + back(module.shared_experts(x))
        return out

    # ---- islands --------------------------------------------------------------------------------------------
    def mla_decode(self, q: jax.Array, cache, block_table: jax.Array, seq_lens: jax.Array, **kwargs):
        """pallas_kernels.mla_decode on each device's part: TP — all sequences, H/N heads (q [B, Sq, H, 576]
        split on H, the replicated cache); DP attention — B/N sequences with all heads, the device's own cache
        pages (block-table entries are global page ids; each device maps them to its local pages)."""
        import pallas_kernels
        if self.num_devices == 1:
            return pallas_kernels.mla_decode(q, cache, block_table, seq_lens, **kwargs)
        if self.data_parallel_attention:
            pages_local = _num_pages(cache) // self.num_devices

            def body(q, cache, block_table, seq_lens):
                first = jax.lax.axis_index(AXIS) * pages_local
                local = block_table - first
                # Only padding entries (past a sequence's length) may name another device's page; -1 keeps a bad
                # live entry loud (mla_decode returns NaN for a used page outside the pool).
                local = jnp.where((local >= 0) & (local < pages_local), local, -1)
                return pallas_kernels.mla_decode(q, cache, local, seq_lens, **kwargs)

            rows = P(AXIS)
            in_specs = (rows, self.cache_specs(cache), rows, rows)
            out_specs = (rows, rows)
        else:
            def body(q, cache, block_table, seq_lens):
                return pallas_kernels.mla_decode(q, cache, block_table, seq_lens, **kwargs)

            heads = P(None, None, AXIS)
            in_specs = (heads, self.cache_specs(cache), P(), P())
            out_specs = (heads, P(None, AXIS))          # out [B, Sq, H, 512], lse [B, H, Sq]
        return jax.shard_map(body, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs,
                             check_vma=False)(q, cache, block_table, seq_lens)

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

    def read_pages(self, gather: Callable, cache, block_table: jax.Array) -> tuple[jax.Array, jax.Array]:
        """gather(cache, block_table) -> (latent [N, P·ps, ·], rope [N, P·ps, ·]), each row's pages dequantized
        (the engine's `read_pages`), with the rows replicated. TP: plain (the cache is replicated). DP attention:
        each device gathers the pages it owns and zeros the rest, and a sum over devices assembles every row
        (each page has exactly one owner). Used by the prefill step to read a chunk's cached prefix."""
        if self.num_devices == 1 or not self.data_parallel_attention:
            return gather(cache, block_table)
        pages_local = _num_pages(cache) // self.num_devices
        page_size = _page_size(cache)

        def body(cache, block_table):
            local = block_table - jax.lax.axis_index(AXIS) * pages_local
            owned = (local >= 0) & (local < pages_local)                        # [N, P]
            latent, rope = gather(cache, jnp.where(owned, local, 0))
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
        """Expert-parallel routed experts: Σ_k w[t,k]·expert_{idx[t,k]}(x[t]) with the experts split over devices.

        x [T, D], topk_idx / topk_w [T, K], replicated (every device sees every token: that is the dispatch).
        Each device runs its own E/N experts on the pairs routed to them. Pairs routed elsewhere get weight 0 and,
        for AWQExperts, the out-of-range expert index E, which its tiling drops (no compute; checked by
        tests/sharding_8dev_cases.py); other Experts modules get index 0, since their call contract has no
        "no expert" index (a wasted row, still exact). Combine: a sum over devices in fp32 — psum (result
        replicated) or, with scatter_rows, psum_scatter (device d keeps rows [d·T/N, (d+1)·T/N), the decode row
        layout of data-parallel attention). Returns [T, D] in x.dtype."""
        if self.num_devices == 1:
            return experts_module(x, topk_idx, topk_w)
        from flax import nnx
        n = self.num_devices
        graphdef, state = nnx.split(experts_module)
        num_local = _leading_dim(state) // n
        # AWQExperts sizes its tiling by its num_experts attribute (E, not E/N): an index >= E is dropped
        elsewhere = experts_module.num_experts if _skips_out_of_range_experts(experts_module) else 0
        if scatter_rows and x.shape[0] % n:
            raise ValueError(f"{x.shape[0]} token rows do not split evenly over {n} devices (data-parallel "
                             "attention needs the decode batch padded to a multiple of the device count)")

        def body(state, x, topk_idx, topk_w):
            local = topk_idx - jax.lax.axis_index(AXIS) * num_local
            mine = (local >= 0) & (local < num_local)
            y = nnx.merge(graphdef, state)(x, jnp.where(mine, local, elsewhere), jnp.where(mine, topk_w, 0))
            # Sum partial outputs in fp32: a bf16 sum over devices would round N-1 more times than one device.
            y = y.astype(jnp.float32)
            if scatter_rows:
                y = jax.lax.psum_scatter(y, AXIS, scatter_dimension=0, tiled=True)
            else:
                y = jax.lax.psum(y, AXIS)
            return y.astype(x.dtype)

        state_specs = jax.tree.map(lambda a: P(AXIS), state)
        return jax.shard_map(body, mesh=self.mesh, in_specs=(state_specs, P(), P(), P()),
                             out_specs=P(AXIS) if scatter_rows else P(),
                             check_vma=False)(state, x, topk_idx, topk_w)


class SingleDevice:
    """The operations of ShardingPlan that the engine's step functions call, for an unsharded run (plain calls).
    `ops(plan)` picks between the two, so the step functions read the same either way."""
    num_devices = 1
    data_parallel_attention = False

    @staticmethod
    def mla_decode(q, cache, block_table, seq_lens, **kwargs):
        import pallas_kernels
        return pallas_kernels.mla_decode(q, cache, block_table, seq_lens, **kwargs)

    @staticmethod
    def write_cache(cache, slots, latent, rope):
        return cache.write(slots, latent, rope)

    @staticmethod
    def read_pages(gather, cache, block_table):
        return gather(cache, block_table)

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


def _skips_out_of_range_experts(module) -> bool:
    """AWQExperts routes pairs through route_tiles, whose per-expert counts (bincount with length E) leave out an
    index >= E: such pairs land in no tile and cost nothing."""
    try:
        from mla_jax.quant.awq import AWQExperts
    except ImportError:
        return False
    return isinstance(module, AWQExperts)


def _num_pages(cache) -> int:
    leaf = jax.tree.leaves(cache)[0]
    return leaf.shape[_cache_page_axis(leaf.ndim)]


def _page_size(cache) -> int:
    if hasattr(cache, "page_size"):
        return int(cache.page_size)
    leaf = jax.tree.leaves(cache)[0]
    return leaf.shape[leaf.ndim - 2]


def _leading_dim(state) -> int:
    dims = {a.shape[0] for a in jax.tree.leaves(state)}
    if len(dims) != 1:
        raise ValueError(f"expert parameters must all lead with the expert axis; leading sizes seen: {dims}")
    return dims.pop()


# ---------------------------------------------------------------------------------------------------------------
# Memory accounting (dry runs and reports)
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


# ---------------------------------------------------------------------------------------------------------------
# Sharded loading of HF safetensors checkpoints
# ---------------------------------------------------------------------------------------------------------------

def _hf_index(our_index: tuple, our_shape: tuple, hf_shape: tuple, transpose: bool):
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


def load_sharded(path, plan: ShardingPlan, dtype="float32"):
    """(model, cfg) from an HF checkpoint directory (or a converted one: `load_converted_sharded`) with every
    parameter placed by the plan's rules as it is read: each device's slice is read from the safetensors file
    directly (jax.make_array_from_callback over safetensors slices), so no process holds a full copy of a sharded
    weight, and with several processes each reads only what its own devices hold. Same checks as
    mla_jax.load_model (names, shapes, dtypes)."""
    import contextlib
    import os

    from flax import nnx
    from safetensors import safe_open

    from mla_jax.checkpoint import hf
    from mla_jax.config import ModelConfig
    from mla_jax.model.transformer import DeepseekV3

    from mla_jax.checkpoint import converted

    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path} is not a directory; expected an HF model directory with config.json")
    if converted.is_converted(path):
        return load_converted_sharded(path, plan, dtype)
    cfg = ModelConfig.from_pretrained(path)
    check_config(cfg, plan.num_devices, plan.data_parallel_attention)
    jdtype = hf._resolve_dtype(dtype)
    model = nnx.eval_shape(lambda: DeepseekV3(cfg, dtype=jdtype, rngs=nnx.Rngs(0)))
    model_dtype = np.dtype(jdtype)
    targets = hf.hf_param_map(cfg)
    index = hf.read_tensor_index(path)

    # Names and shapes, from headers, before any data (the messages of mla_jax.checkpoint.hf).
    for name, (fn, shape, _) in index.items():
        if name in targets:
            if tuple(shape) != tuple(targets[name].hf_shape):
                raise ValueError(f"tensor {name!r} in {os.path.basename(fn)} has shape {tuple(shape)}, but the "
                                 f"model (from config.json) expects shape {tuple(targets[name].hf_shape)}")
        elif not (hf._mtp_layer(name, cfg) or name.endswith(hf._IGNORED_SUFFIXES)
                  or (name == "lm_head.weight" and cfg.tie_word_embeddings)):
            raise ValueError(f"unexpected tensor {name!r} with shape {tuple(shape)} in {os.path.basename(fn)}: "
                             "no parameter of the model (from config.json) has that name")
    missing = [n for n in targets if n not in index]
    if missing:
        shown = "; ".join(f"{n} (expected shape {targets[n].hf_shape})" for n in missing[:8])
        raise ValueError(f"checkpoint {path} is missing {len(missing)} tensor(s): {shown}")

    groups: dict[tuple, dict] = {}          # param path -> {expert index or None: hf name}
    for name, t in targets.items():
        groups.setdefault(t.path, {})[t.expert] = name

    with contextlib.ExitStack() as stack:
        files: dict[str, Any] = {}

        def read(name: str, idx: Optional[tuple]) -> np.ndarray:
            fn = index[name][0]
            if fn not in files:
                files[fn] = stack.enter_context(safe_open(fn, framework="numpy"))
            sl = files[fn].get_slice(name)
            return sl[idx] if idx is not None else sl[:]

        def piece(name: str, our_index: tuple, our_shape: tuple) -> np.ndarray:
            """Our parameter's slice `our_index` of the (per-expert) tensor `name`."""
            t = targets[name]
            hf_idx = _hf_index(our_index, our_shape, t.hf_shape, t.transpose)
            arr = hf._convert(read(name, hf_idx), index[name][2], t, model_dtype, name)
            if hf_idx is None:
                arr = arr[our_index]
            want = tuple(len(range(*s.indices(n))) for s, n in zip(our_index, our_shape))
            if arr.shape != want:
                raise ValueError(f"internal: slice {our_index} of {name} converted to shape {arr.shape}, "
                                 f"expected {want}")
            return arr

        for ppath, names in groups.items():
            t0 = targets[next(iter(names.values()))]
            var = getattr(hf._module_at(model, t0.module), t0.param)
            abstract = var.get_value()
            shape, pdtype = tuple(abstract.shape), abstract.dtype
            sharding = plan.sharding(plan.param_spec(path_str(ppath), shape))
            if None in names:                                 # one HF tensor -> the whole parameter
                def cb(idx, name=names[None], shape=shape):
                    return piece(name, idx, shape)
            else:                                             # per-expert HF tensors -> stacked [E, ...]
                if sorted(names) != list(range(shape[0])):
                    raise ValueError(f"internal: experts of {ppath} in the name map: {sorted(names)}")

                def cb(idx, names=names, shape=shape):
                    experts = range(*idx[0].indices(shape[0]))
                    return np.stack([piece(names[e], idx[1:], shape[1:]) for e in experts])
            var.set_value(jax.make_array_from_callback(shape, sharding, cb, dtype=pdtype))

    for p, v in nnx.to_flat_state(nnx.state(model)):
        if isinstance(v.get_value(), jax.ShapeDtypeStruct):
            raise ValueError(f"parameter {p} was not filled by any checkpoint tensor (hf_param_map is incomplete)")
    return model, cfg


def _unpack_nibbles(b: jax.Array) -> jax.Array:
    """uint8 [..., n/2] -> int4 [..., n]: element 2i is the low nibble of byte i (the converted format's packing),
    by arithmetic, so the result does not depend on how a backend lays int4 out in memory."""
    lo, hi = (b & 0xF).astype(jnp.int8), (b >> 4).astype(jnp.int8)
    v = jnp.stack([lo, hi], axis=-1).reshape(*b.shape[:-1], -1)
    return ((v ^ 8) - 8).astype(jnp.int4)                      # sign-extend the 4-bit two's complement


def load_converted_sharded(path, plan: ShardingPlan, dtype="float32"):
    """(model, cfg) from a directory written by scripts/convert.py (mla_jax.checkpoint.converted), restored by
    orbax straight into the plan's shardings: tensorstore reads each device's slice, so no process holds a full
    copy of a sharded weight. Names, shapes and dtypes are checked against the manifest and the model as in
    `load_converted`; the per-tensor crc32 (of whole arrays) is not, since no process sees a whole sharded array
    — verify a copied checkpoint once with mla_jax.checkpoint.converted.load_converted(verify_checksums=True)."""
    import json
    import os

    import orbax.checkpoint as ocp

    from mla_jax.checkpoint import converted
    from mla_jax.checkpoint.hf import _resolve_dtype
    from mla_jax.config import ModelConfig

    path = os.fspath(path)
    with open(os.path.join(path, converted.MANIFEST)) as f:
        manifest = json.load(f)
    if manifest.get("format") != converted.FORMAT or manifest.get("version") != converted.VERSION:
        raise ValueError(f"{path}/{converted.MANIFEST}: format {manifest.get('format')!r} version "
                         f"{manifest.get('version')!r} is not {converted.FORMAT!r} version {converted.VERSION}; "
                         "re-run scripts/convert.py")
    cfg = ModelConfig.from_pretrained(path)
    check_config(cfg, plan.num_devices, plan.data_parallel_attention)
    jdtype = _resolve_dtype(dtype)
    model, params = converted._abstract_params(cfg, jdtype)
    converted._check_against_manifest(manifest, params, np.dtype(jdtype), path)
    entries = manifest["tensors"]
    by_group: dict[str, list[str]] = {}
    for name in params:
        by_group.setdefault(entries[name]["group"], []).append(name)
    ckpt = ocp.PyTreeCheckpointer()
    for group, names in by_group.items():
        gdir = os.path.join(path, converted.WEIGHTS, group)
        if not os.path.isdir(gdir):
            raise ValueError(f"converted checkpoint {path}: weights/{group} is missing (holds tensor "
                             f"{names[0]!r}); re-run scripts/convert.py")
        args, stored = {}, {}
        for name in names:
            p, want = params[name]
            spec = plan.param_spec(path_str(p), want.shape)
            shape, dtype = tuple(want.shape), want.dtype
            if entries[name].get("stored_as") == getattr(converted, "INT4_NIBBLES", None):
                # int4 [..., n] is stored as uint8 [..., n/2] (two per byte): restore the bytes with the same
                # split and unpack them on the devices
                shape, dtype = (*shape[:-1], shape[-1] // 2), np.dtype(np.uint8)
                if len(spec) == len(shape) and spec[-1] is not None and shape[-1] % plan.num_devices:
                    raise ValueError(f"converted checkpoint {path}: int4 tensor {name!r} is stored two per byte "
                                     f"({shape[-1]} bytes a row), which {plan.num_devices} devices cannot split "
                                     "evenly; load it with a device count that divides that")
            stored[name] = (shape, dtype, spec)
            args[name] = ocp.ArrayRestoreArgs(sharding=plan.sharding(spec), global_shape=shape, dtype=dtype)
        arrays = ckpt.restore(gdir, args=ocp.args.PyTreeRestore(restore_args=args))
        for name in names:
            p, want = params[name]
            a = arrays.pop(name)
            shape, dtype, spec = stored[name]
            if tuple(a.shape) != shape or a.dtype != dtype:
                raise ValueError(f"converted checkpoint {path}: tensor {name!r} restored as {a.dtype}"
                                 f"{tuple(a.shape)}, expected {dtype}{shape}")
            if dtype != want.dtype:
                a = jax.jit(_unpack_nibbles, out_shardings=plan.sharding(spec))(a)
            converted._variable(model, p).set_value(a)
    logger.info("restored %s sharded over %d devices (crc32 not verified in the sharded path)", path,
                plan.num_devices)
    return model, cfg


# ---------------------------------------------------------------------------------------------------------------
# Page pools for data-parallel attention (host-side bookkeeping for the engine's scheduler)
# ---------------------------------------------------------------------------------------------------------------

class DevicePagePools:
    """The KV-cache pages split into one pool per device, for data-parallel attention: device d holds global pages
    [d·P/N, (d+1)·P/N) (the cache's page axis is split that way) and every page of a sequence comes from one
    device's pool, the device whose decode rows the sequence occupies.

    Same interface as mla_jax.engine.paged.PageAllocator, plus:
    - `near`: can_allocate / allocate for a sequence that already holds pages take them from that sequence's pool;
      without `near` they start a new sequence on the device with the most free pages among those with a free
      decode row (at most `max_seqs_per_device` sequences per device).
    - free(pages) releases a whole sequence (the scheduler frees all of a request's pages at once).
    - shares_pool(a, b): whether freeing sequence a's pages can make room for sequence b.
    - device_of(pages).
    Each device keeps its local page 0 as a scratch page, like the single pool's page 0 (global page 0, the
    engine's scratch page, is device 0's).
    """

    def __init__(self, num_pages: int, page_size: int, num_devices: int, max_seqs_per_device: int):
        from mla_jax.engine.paged import PageAllocator
        if num_devices < 1 or num_pages % num_devices:
            raise ValueError(f"data-parallel attention over {num_devices} devices splits the KV cache's pages "
                             f"evenly: num_pages={num_pages} is not a multiple of {num_devices}")
        if max_seqs_per_device < 1:
            raise ValueError(f"max_seqs_per_device must be >= 1, got {max_seqs_per_device}")
        self.num_pages, self.page_size, self.num_devices = num_pages, page_size, num_devices
        self.pages_per_device = num_pages // num_devices
        self.max_seqs_per_device = max_seqs_per_device
        self._pools = [PageAllocator(self.pages_per_device, page_size) for _ in range(num_devices)]
        self._seqs = [0] * num_devices

    @property
    def num_usable(self) -> int:
        """Pages one sequence can hold at most (one device's pool)."""
        return self._pools[0].num_usable

    @property
    def num_free(self) -> int:
        return sum(p.num_free for p in self._pools)

    def pages_for(self, num_tokens: int) -> int:
        return self._pools[0].pages_for(num_tokens)

    def device_of(self, pages) -> int:
        devices = {int(p) // self.pages_per_device for p in pages}
        if len(devices) != 1:
            raise RuntimeError(f"pages {list(pages)[:8]} do not belong to exactly one device's pool: {devices}")
        return devices.pop()

    def seqs_on(self, device: int) -> int:
        return self._seqs[device]

    def _new_seq_device(self, n: int) -> Optional[int]:
        ok = [d for d in range(self.num_devices)
              if self._seqs[d] < self.max_seqs_per_device and self._pools[d].can_allocate(n)]
        if not ok:
            return None
        return max(ok, key=lambda d: (self._pools[d].num_free, -self._seqs[d], -d))

    def can_allocate(self, n: int, near=None) -> bool:
        if near:
            return self._pools[self.device_of(near)].can_allocate(n)
        return self._new_seq_device(n) is not None

    def allocate(self, n: int, near=None) -> list[int]:
        if near:
            d = self.device_of(near)
        else:
            d = self._new_seq_device(n)
            if d is None:
                raise RuntimeError(f"no device has a free decode row and {n} free KV-cache pages (the scheduler "
                                   "must check can_allocate first)")
            self._seqs[d] += 1
        first = d * self.pages_per_device
        return [first + p for p in self._pools[d].allocate(n)]

    def free(self, pages: list[int]) -> None:
        if not pages:
            return
        d = self.device_of(pages)
        first = d * self.pages_per_device
        self._pools[d].free([p - first for p in pages])
        self._seqs[d] -= 1

    def shares_pool(self, a, b) -> bool:
        return bool(a) and bool(b) and self.device_of(a) == self.device_of(b)


# ---------------------------------------------------------------------------------------------------------------
# Abstract sharded plans (dry runs: full-size shapes, no allocation)
# ---------------------------------------------------------------------------------------------------------------

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
    from flax import nnx

    from mla_jax.engine.steps import EngineWeights, allocate_caches
    from mla_jax.model.transformer import DeepseekV3

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


# ---------------------------------------------------------------------------------------------------------------
# Engine helpers
# ---------------------------------------------------------------------------------------------------------------

def allocate_sharded(plan: ShardingPlan, allocate: Callable[[], Any]) -> Any:
    """Runs allocate() (e.g. the engine's per-layer cache allocation) under jit with the plan's cache layout as
    the output sharding, so each device creates only its part (no full copy on one device first)."""
    abstract = jax.eval_shape(allocate)
    return jax.jit(allocate, out_shardings=plan.cache_shardings(abstract))()


def decode_rows_by_device(requests: Sequence, pools: DevicePagePools, buckets: Sequence[int]) -> list:
    """Rows of a data-parallel-attention decode batch: device d's requests (by their pages' pool) fill rows
    [d·Bl, d·Bl + count_d) in order, the rest of its Bl rows are padding (None); Bl is the smallest bucket that
    holds the busiest device's requests. Returns a list of N·Bl requests-or-None."""
    per_device: list[list] = [[] for _ in range(pools.num_devices)]
    for r in requests:
        per_device[pools.device_of(r.pages)].append(r)
    need = max(len(rs) for rs in per_device)
    bl = next((b for b in buckets if b >= need), None)
    if bl is None:
        raise ValueError(f"{need} decode rows on one device exceed the largest per-device bucket {buckets[-1]}")
    rows: list = []
    for rs in per_device:
        rows += rs + [None] * (bl - len(rs))
    return rows


def init_sharded(cfg, plan: ShardingPlan, dtype, seed: int = 0):
    """DeepseekV3(cfg) with its random initial weights (AWQ int4 for quantized configs) created directly in the
    plan's shardings: the init runs under jit with those output shardings, so each device generates only its
    own part (benchmarks of full-size models without a checkpoint)."""
    from flax import nnx

    from mla_jax.model.transformer import DeepseekV3

    check_config(cfg, plan.num_devices, plan.data_parallel_attention)
    abstract = nnx.eval_shape(lambda: DeepseekV3(cfg, dtype=dtype, rngs=nnx.Rngs(seed)))
    graphdef, abstract_state = nnx.split(abstract)
    state = jax.jit(lambda: nnx.state(DeepseekV3(cfg, dtype=dtype, rngs=nnx.Rngs(seed))),
                    out_shardings=plan.param_shardings(abstract_state))()
    return nnx.merge(graphdef, state)
