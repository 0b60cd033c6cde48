"""Expert-parallel routed experts over one mesh axis: the two dispatch paths (docs/architecture.md §7).

The routed experts are stacked on a leading expert axis and split over the N devices of the axis: device d holds
experts [d·E/N, (d+1)·E/N) ("local" experts, local index e - d·E/N). Both paths compute, for every token t,
    out[t] = Σ_k w[t,k] · expert_{idx[t,k]}(x[t])
exactly (no capacity limit drops a pair), as the sum over devices of each device's partial output (its own
experts' pairs), in fp32.

- "all_gather" (the reference, `experts_all_gather`): every device receives every token (the inputs are
  replicated, or all-gathered), runs its local experts on the pairs routed to them (other pairs: the module's
  `padding_expert_index`, weight 0), and the partial outputs [T, D] are summed over devices in fp32 (psum, or
  psum_scatter when the caller keeps rows split). Per device and layer this moves all T rows in and an fp32
  [T, D] reduction out, whatever the routing.
- "all_to_all" (`experts_all_to_all`): each device owns T/N of the tokens (its own rows when rows are split,
  else a 1/N slice of the replicated tokens). It sends each of its tokens once to every device that holds at
  least one of the token's K experts (one row per (token, device), not per (token, expert): DeepSeek V3's
  group-limited routing sends a token to at most topk_group of 8 devices), together with the token's
  [K] expert ids and weights. A receiving device calls the experts module on the rows it received, with the
  pairs of other devices set to `padding_expert_index` / weight 0, and sends each row's weighted partial output
  (in the activation dtype, as the module returns it) back to where it came from; the source sums the partials
  of a token in fp32. Replicated callers then all-gather the owned rows.
  The exchange is `jax.lax.all_to_all` over a static buffer of `capacity` rows per (source, destination) pair.
  `capacity_factor` 1.0 (the default) sizes it for the worst case (every local token to one device), so it cannot
  overflow. A smaller factor moves fewer bytes; when any device would send more rows to one peer than fit, every
  device takes the all-gather path for that call instead (a `lax.cond` on a flag reduced over the axis, so the
  branches' collectives match): tokens are never dropped.
  (`jax.lax.ragged_all_to_all` would move only the rows that exist, but XLA:CPU does not implement it in
  jax 0.11.2 — "HLO opcode ragged-all-to-all is not supported by XLA:CPU" — so a path built on it could not be
  tested on simulated devices.)

Both functions run inside `jax.shard_map` bodies built here; the caller (mla_jax.sharding.ShardingPlan.experts)
supplies the mesh and axis name. This module imports nothing else from mla_jax.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P

DISPATCHES = ("all_gather", "all_to_all")
"""The selectable expert dispatch paths (ShardingPlan.expert_dispatch, LLM(expert_dispatch=...))."""


def check_dispatch(expert_dispatch: str, capacity_factor: Optional[float]) -> None:
    if expert_dispatch not in DISPATCHES:
        raise ValueError(f"expert_dispatch={expert_dispatch!r}: choose one of {DISPATCHES}")
    if capacity_factor is not None and not 0.0 < float(capacity_factor) <= 1.0:
        raise ValueError(f"expert_capacity_factor={capacity_factor!r} must be in (0, 1]: the rows one device may "
                         "send to one peer, as a fraction of its own token rows (1.0: the worst case, never "
                         "overflows; smaller moves fewer bytes and falls back to all-gather when exceeded)")


def peer_capacity(rows_per_device: int, capacity_factor: Optional[float]) -> int:
    """Static rows per (source, destination) buffer: ceil(factor · rows_per_device), at least 1."""
    factor = 1.0 if capacity_factor is None else float(capacity_factor)
    return max(1, min(rows_per_device, math.ceil(factor * rows_per_device)))


def _split_state(experts_module, num_devices: int):
    graphdef, state = nnx.split(experts_module)
    dims = {a.shape[0] for a in jax.tree.leaves(state)}
    if len(dims) != 1:
        raise ValueError(f"expert parameters must all lead with the expert axis; leading sizes seen: {dims}")
    num_experts = dims.pop()
    if num_experts % num_devices:
        raise ValueError(f"{num_experts} experts do not split evenly over {num_devices} devices")
    return graphdef, state, num_experts // num_devices


def _local_pairs(topk_idx, topk_w, device, num_local: int, padding_index: int, valid=None):
    """The pairs of `device`'s experts as local indices; the others -> (padding_index, weight 0)."""
    local = topk_idx - device * num_local
    mine = (local >= 0) & (local < num_local)
    if valid is not None:
        mine = mine & valid[:, None]
    return jnp.where(mine, local, padding_index), jnp.where(mine, topk_w, 0.0)


def _partial_on_all_rows(module, x, topk_idx, topk_w, axis_name, num_local, padding_index, valid=None):
    """This device's experts on every row of x (pairs of other devices padded): fp32 [T, D] partial output. A
    sum over devices in fp32, because a bf16 sum would round N-1 more times than one device does."""
    idx, w = _local_pairs(topk_idx, topk_w, jax.lax.axis_index(axis_name), num_local, padding_index, valid)
    return module(x, idx, w).astype(jnp.float32)


def experts_all_gather(mesh: Mesh, axis_name: str, experts_module, x, topk_idx, topk_w, *,
                       scatter_rows: bool = False):
    """The reference dispatch. x [T, D], topk_idx int32 / topk_w f32 [T, K], replicated (every device sees every
    token: that is the dispatch). Combine: psum (result replicated) or, with scatter_rows, psum_scatter (device d
    keeps rows [d·T/N, (d+1)·T/N), the decode row layout of data-parallel attention). Returns [T, D] in x.dtype."""
    n = mesh.shape[axis_name]
    graphdef, state, num_local = _split_state(experts_module, n)
    padding = experts_module.padding_expert_index
    if scatter_rows and x.shape[0] % n:
        raise ValueError(f"{x.shape[0]} token rows do not split evenly over {n} devices (data-parallel "
                         "attention needs the decode batch padded to a multiple of the device count)")

    def body(state, x, topk_idx, topk_w):
        y = _partial_on_all_rows(nnx.merge(graphdef, state), x, topk_idx, topk_w, axis_name, num_local, padding)
        if scatter_rows:
            y = jax.lax.psum_scatter(y, axis_name, scatter_dimension=0, tiled=True)
        else:
            y = jax.lax.psum(y, axis_name)
        return y.astype(x.dtype)

    state_specs = jax.tree.map(lambda a: P(axis_name), state)
    return jax.shard_map(body, mesh=mesh, in_specs=(state_specs, P(), P(), P()),
                         out_specs=P(axis_name) if scatter_rows else P(),
                         check_vma=False)(state, x, topk_idx, topk_w)


def _exchange_rows(module, x, topk_idx, topk_w, valid, axis_name: str, n: int, num_local: int, padding: int,
                   capacity: int):
    """The all-to-all path on this device's rows x [R, D] (valid [R]: rows that are real tokens): fp32 [R, D]
    sums over the devices holding each row's experts. Rows beyond `capacity` per peer are not sent; the caller
    checks first that none are (`_peer_counts`)."""
    R = x.shape[0]
    goes = _destinations(topk_idx, valid, n, num_local)                       # [R, N]: row r needs device p
    pos = jnp.cumsum(goes, axis=0, dtype=jnp.int32) - 1                       # its place in p's buffer
    slot = jnp.where(goes & (pos < capacity), jnp.arange(n, dtype=jnp.int32) * capacity + pos, n * capacity)
    # the source row of every send slot (R: an empty slot), from the slots of every (row, device)
    slot_row = jnp.full((n * capacity,), R, jnp.int32).at[slot.reshape(-1)].set(
        jnp.repeat(jnp.arange(R, dtype=jnp.int32), n), mode="drop")
    filled = slot_row < R
    send_x = jnp.take(x, slot_row, axis=0, mode="fill", fill_value=0)
    send_idx = jnp.where(filled[:, None], jnp.take(topk_idx, slot_row, axis=0, mode="clip"), -1)
    send_w = jnp.where(filled[:, None], jnp.take(topk_w, slot_row, axis=0, mode="clip"), 0.0)

    def exchange(a):     # chunk p of the buffer goes to device p; chunk s of the result came from device s
        return jax.lax.all_to_all(a, axis_name, 0, 0, tiled=True)

    recv_x, recv_idx, recv_w = exchange(send_x), exchange(send_idx), exchange(send_w)
    idx, w = _local_pairs(recv_idx, recv_w, jax.lax.axis_index(axis_name), num_local, padding)
    partial = exchange(module(recv_x, idx, w))                                # [N·C, D] back at the sources
    per_device = jnp.take(partial, slot, axis=0, mode="fill", fill_value=0)   # [R, N, D] (0 where not sent)
    return per_device.astype(jnp.float32).sum(axis=1)


def _destinations(topk_idx, valid, n: int, num_local: int):
    """bool [R, N]: row r has at least one of its K experts on device p (and is a real token)."""
    dest = topk_idx // num_local
    goes = jnp.any(dest[:, :, None] == jnp.arange(n, dtype=dest.dtype), axis=1)
    return goes if valid is None else goes & valid[:, None]


def _overflows(topk_idx, valid, axis_name: str, n: int, num_local: int, capacity: int):
    """True on every device when any device has more than `capacity` rows for one peer."""
    counts = _destinations(topk_idx, valid, n, num_local).sum(axis=0)          # [N] rows per peer
    return jax.lax.pmax(jnp.max(counts), axis_name) > capacity


def experts_all_to_all(mesh: Mesh, axis_name: str, experts_module, x, topk_idx, topk_w, *,
                       scatter_rows: bool = False, capacity_factor: Optional[float] = None,
                       with_overflow: bool = False):
    """The all-to-all dispatch (module docstring). Same arguments and result as `experts_all_gather`:
    x [T, D], topk_idx int32 / topk_w f32 [T, K]; returns [T, D] in x.dtype, replicated, or with scatter_rows
    split by rows (the inputs then arrive split the same way; T must divide). Replicated inputs need not divide:
    they are padded to a multiple of N with rows that send nothing.

    capacity_factor: rows one device may send to one peer, as a fraction of its own rows (default 1.0: the
    worst case, no overflow possible). with_overflow: also return a bool, True when the call overflowed and
    took the all-gather path (for tests and measurements)."""
    n = mesh.shape[axis_name]
    graphdef, state, num_local = _split_state(experts_module, n)
    padding = experts_module.padding_expert_index
    T = x.shape[0]
    if scatter_rows and T % n:
        raise ValueError(f"{T} token rows do not split evenly over {n} devices (data-parallel "
                         "attention needs the decode batch padded to a multiple of the device count)")
    rows = -(-T // n)
    valid = None
    if not scatter_rows and rows * n != T:
        pad = rows * n - T
        x = jnp.pad(x, ((0, pad), (0, 0)))
        topk_idx = jnp.pad(topk_idx, ((0, pad), (0, 0)))
        topk_w = jnp.pad(topk_w, ((0, pad), (0, 0)))
        valid = jnp.arange(rows * n) < T
    capacity = peer_capacity(rows, capacity_factor)

    def body(state, x, topk_idx, topk_w, valid):
        module = nnx.merge(graphdef, state)
        exchange = functools.partial(_exchange_rows, module, axis_name=axis_name, n=n, num_local=num_local,
                                     padding=padding, capacity=capacity)
        if capacity >= rows:                       # sized for the worst case: nothing to check
            overflowed = jnp.zeros((), jnp.bool_)
            y = exchange(x, topk_idx, topk_w, valid)
        else:
            overflowed = _overflows(topk_idx, valid, axis_name, n, num_local, capacity)
            y = jax.lax.cond(overflowed, functools.partial(_gathered_rows, module, axis_name=axis_name,
                                                           num_local=num_local, padding=padding),
                             exchange, x, topk_idx, topk_w, valid)
        if not scatter_rows:
            y = jax.lax.all_gather(y.astype(x.dtype), axis_name, tiled=True)
        return y.astype(x.dtype), overflowed

    if valid is None:
        valid = jnp.ones((rows * n,), jnp.bool_)
    state_specs = jax.tree.map(lambda a: P(axis_name), state)
    rows_spec = P(axis_name)
    out, overflowed = jax.shard_map(
        body, mesh=mesh, in_specs=(state_specs, rows_spec, rows_spec, rows_spec, rows_spec),
        out_specs=(rows_spec if scatter_rows else P(), P()), check_vma=False)(state, x, topk_idx, topk_w, valid)
    out = out[:T]
    return (out, overflowed) if with_overflow else out


def _gathered_rows(module, x, topk_idx, topk_w, valid, *, axis_name: str, num_local: int, padding: int):
    """The fallback on this device's rows: all-gather every device's rows, run the local experts on all of
    them, reduce-scatter the fp32 partials back to their rows (the reference path on split rows)."""
    gather = functools.partial(jax.lax.all_gather, axis_name=axis_name, tiled=True)
    y = _partial_on_all_rows(module, gather(x), gather(topk_idx), gather(topk_w), axis_name, num_local, padding,
                             gather(valid))
    return jax.lax.psum_scatter(y, axis_name, scatter_dimension=0, tiled=True)
