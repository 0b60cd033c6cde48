"""Fused decode: k decode steps plus sampling and stop checks in one jitted call, its inputs in one int32 buffer.

`decode_loop` runs up to `max_steps` decode steps (`steps.decode_step`, then `sampling.sample`) in one
`lax.while_loop` on the device. Each row feeds its newest token, samples the next one and feeds that in the next
iteration; a row stops (on the device) when it samples one of its stop tokens (eos unless ignore_eos, and its
stop_token_ids) or has generated as many tokens as it may (`remaining`: min of what max_tokens and max_model_len
leave). A stopped row behaves like a padding row from then on: it writes nothing (slot -1) and reads no cache
(seq_len 0). The loop ends after `num_steps` iterations (a traced value <= max_steps, so one compiled variant
serves every k) or when every row stopped. The host replays the same stop rule on the returned tokens
(Scheduler.check_stop), so the device's rule only decides early exit and which rows keep writing.

Rows can continue a previous call's rows without the host seeing their tokens: `prev_row[b] >= 0` takes row b's
first token (and stopped flag) from row prev_row[b] of the previous call's result, which is still on the device
(the overlap scheduler, llm.py). So the device never waits for the host between calls.

Every per-step host input (tokens, positions, block table, sampling parameters, stop tokens, ...) travels in one
int32 buffer (`pack_inputs`; float32 fields are bit-cast), one host-to-device transfer per call; the result comes
back as one int32 array [2 * max_steps + 1, B] (tokens, logprob bits, stopped flags), one transfer back.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .cache_storage import as_stored, from_stored
from .sampling import sample
from .steps import decode_step

# name -> (dtype of the field, trailing shape given (W, S)); every field has B rows
_FIELDS = (
    ("tokens", np.int32, lambda w, s: ()),          # newest token of the row (used where prev_row < 0)
    ("prev_row", np.int32, lambda w, s: ()),        # row of the previous call's result to continue, or -1
    ("positions", np.int32, lambda w, s: ()),       # position of the first token fed
    ("remaining", np.int32, lambda w, s: ()),       # tokens the row may still generate (0: padding row)
    ("steps", np.int32, lambda w, s: ()),           # tokens the request generated before this call (rng step)
    ("seeds", np.uint32, lambda w, s: ()),
    ("temperature", np.float32, lambda w, s: ()),
    ("top_k", np.int32, lambda w, s: ()),
    ("top_p", np.float32, lambda w, s: ()),
    ("stop_ids", np.int32, lambda w, s: (s,)),      # tokens that stop the row (-1: unused entry)
    ("block_table", np.int32, lambda w, s: (w,)),
)


@dataclasses.dataclass(frozen=True)
class InputLayout:
    """Where each field of a call with B rows, block-table width W and S stop slots sits in the flat buffer."""
    batch: int
    width: int
    stop_slots: int

    @property
    def fields(self) -> list[tuple[str, np.dtype, tuple[int, ...], int, int]]:
        out, offset = [], 1                 # word 0: the number of steps to run
        for name, dtype, trailing in _FIELDS:
            shape = (self.batch, *trailing(self.width, self.stop_slots))
            size = int(np.prod(shape))
            out.append((name, np.dtype(dtype), shape, offset, size))
            offset += size
        return out

    @property
    def size(self) -> int:
        name, _, _, offset, size = self.fields[-1]
        return offset + size


def pack_inputs(layout: InputLayout, num_steps: int, **fields: np.ndarray) -> np.ndarray:
    """The int32 buffer of one decode_loop call. fields: every name of _FIELDS, shaped as the layout says."""
    buf = np.empty(layout.size, np.int32)
    buf[0] = num_steps
    for name, dtype, shape, offset, size in layout.fields:
        value = np.asarray(fields.pop(name), dtype=dtype)
        if value.shape != shape:
            raise ValueError(f"decode input {name}: shape {value.shape}, expected {shape}")
        buf[offset: offset + size] = value.reshape(-1).view(np.int32)
    if fields:
        raise ValueError(f"unknown decode inputs {sorted(fields)}")
    return buf


def _unpack(layout: InputLayout, buf: jax.Array) -> tuple[jax.Array, dict]:
    out = {}
    for name, dtype, shape, offset, size in layout.fields:
        words = jax.lax.slice(buf, (offset,), (offset + size,)).reshape(shape)
        out[name] = words if dtype == np.int32 else jax.lax.bitcast_convert_type(words, jnp.dtype(dtype))
    return buf[0], out


def decode_loop(graphdef, weights, caches: Sequence, buf: jax.Array, prev_tokens: jax.Array,
                prev_stopped: jax.Array, *, layout: InputLayout, max_steps: int, page_size: int,
                backend: str, interpret: bool = False, plan=None):
    """Up to max_steps decode steps with sampling and stop checks (module docstring).

    buf: pack_inputs(layout, ...). prev_tokens int32 [B] / prev_stopped bool [B]: the previous call's last tokens
    and stopped flags (any values when no row continues one: prev_row -1 everywhere). Returns (caches, result
    int32 [2 * max_steps + 1, B] = sampled tokens [max_steps, B] | logprobs as float32 bits [max_steps, B] |
    stopped flags [1, B], last tokens [B], stopped [B]). Tokens of rows and steps past a row's stop (or past the
    steps run) are -1. plan: the mla_jax.sharding.ShardingPlan each step runs under (None: one device).
    """
    num_steps, x = _unpack(layout, buf)
    B = layout.batch
    cont = x["prev_row"] >= 0
    src = jnp.clip(x["prev_row"], 0, prev_tokens.shape[0] - 1)
    tokens = jnp.where(cont, prev_tokens[src], x["tokens"])
    stopped = jnp.where(cont, prev_stopped[src], False) | (x["remaining"] <= 0)
    block_table = x["block_table"]
    out_tokens = jnp.full((max_steps, B), -1, jnp.int32)
    out_logprobs = jnp.zeros((max_steps, B), jnp.float32)

    def cond(state):
        i, _, _, stopped, _, _ = state
        return (i < num_steps) & ~jnp.all(stopped)

    def body(state):
        i, caches, tokens, stopped, out_tokens, out_logprobs = state
        pos = x["positions"] + i
        page = jnp.take_along_axis(block_table, jnp.clip(pos // page_size, 0, layout.width - 1)[:, None], 1)[:, 0]
        slots = jnp.where(stopped, -1, page * page_size + pos % page_size)
        seq_lens = jnp.where(stopped, 0, pos + 1)
        # the loop carries the caches stored (cache_storage.py), so fp8 writes stay in place
        caches, logits = decode_step(graphdef, weights, from_stored(caches), tokens, pos, slots, block_table,
                                     seq_lens, backend=backend, interpret=interpret, plan=plan)
        caches = as_stored(caches)
        new, logprobs = sample(logits, x["temperature"], x["top_k"], x["top_p"], x["seeds"], x["steps"] + i)
        new = jnp.where(stopped, -1, new)
        hit_stop = jnp.any((new[:, None] == x["stop_ids"]) & (x["stop_ids"] >= 0), axis=1)
        stopped = stopped | hit_stop | (i + 1 >= x["remaining"])
        return (i + 1, caches, jnp.where(new >= 0, new, tokens), stopped, out_tokens.at[i].set(new),
                out_logprobs.at[i].set(logprobs))

    state = (jnp.int32(0), as_stored(caches), tokens, stopped, out_tokens, out_logprobs)
    _, caches, tokens, stopped, out_tokens, out_logprobs = jax.lax.while_loop(cond, body, state)
    result = jnp.concatenate([out_tokens, jax.lax.bitcast_convert_type(out_logprobs, jnp.int32),
                              stopped.astype(jnp.int32)[None]], axis=0)
    return from_stored(caches), result, tokens, stopped


def split_result(result: np.ndarray, max_steps: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """decode_loop's result on the host -> (tokens int32 [k, B], logprobs float32 [k, B], stopped bool [B])."""
    tokens = result[:max_steps]
    logprobs = np.ascontiguousarray(result[max_steps: 2 * max_steps]).view(np.float32)
    return tokens, logprobs, result[2 * max_steps].astype(bool)
