"""The engine's decode fast path: fused sampling, multi-step decode and overlapped scheduling (docs/architecture.md
§8, NOTES.md in this folder).

`FastDecoder.step()` is what `LLM._step()` runs when `fused_decode=True` (the default):

- A decode batch runs as one `decode_loop.decode_loop` call: up to `multi_step` decode steps with sampling and
  stop checks on the device, its inputs in one int32 buffer (one host-to-device transfer), its result one int32
  array (one transfer back). Weights go in as a flat list of arrays bound once, so a call does not hash the
  model's graphdef or walk its nnx.State (0.74 ms and 0.2 ms per call on the CPU of NOTES.md).
- k > 1 steps run only while no request can join (nothing waits) and the pool has the pages the k steps need
  without preempting anyone; a request that stops mid-loop (eos, stop token, length) stops writing on the device
  and its remaining tokens are discarded.
- Overlap: before reading a call's tokens, the next call is dispatched when it is a pure continuation: the same
  decode rows (minus the requests that reach their length limit), no request that could be admitted, every
  request still running (not aborted), the pages it needs free. Its first tokens come from the previous call's
  result on the device; rows that stopped on the device stay stopped. Everything else (prefill, admission,
  preemption, requests added or aborted between calls) first reads the in-flight call and then goes through the
  Scheduler exactly as the plain path does.

With a sharding plan (one process) the same call runs over the mesh: the packed inputs are replicated, the caches
keep their shardings through the call (out_shardings) and the result comes back replicated; with data-parallel
attention the k steps' pages must fit in each device's own pool.

Each request's tokens are the plain path's (same per-request seeds, same stop rule replayed on the host by
Scheduler.check_stop, which the device's rule mirrors); only the step at which a finished request's slot is
reused can come one call later. An in-flight token of a request aborted between calls is discarded (its pages
were freed by the abort; the device finishes the in-flight call before any later call reuses them).
"""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from . import paged
from .cache_storage import as_stored, from_stored
from .decode_loop import InputLayout, decode_loop, pack_inputs, split_result
from .scheduler import Request, Status


# XLA runs a lax.while_loop from the host: each iteration launches the body's kernels one by one and copies the
# predicate back. With the command-buffer types WHILE and CONDITIONAL (not in XLA's default list, which is the rest
# of this one) the whole loop is one CUDA graph with a device-side loop. H200, embedded model (NOTES.md): decode
# step 0.75 -> 0.45 ms at batch 1 and 1.41 -> 0.65-0.79 ms at batch 64 (30.9k -> 45-55k tok/s).
GPU_LOOP_COMMAND_BUFFERS = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,WHILE,CONDITIONAL"


def decode_loop_compiler_options(platform: str, xla_flags: str | None = None) -> dict | None:
    """XLA options for the fused decode loop on `platform`: the loop as a CUDA graph on GPUs, unless the user's
    XLA_FLAGS set the command-buffer types themselves (theirs win: per-call options would override them)."""
    xla_flags = os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags
    if platform != "gpu" or "xla_gpu_enable_command_buffer" in xla_flags:
        return None
    return {"xla_gpu_enable_command_buffer": GPU_LOOP_COMMAND_BUFFERS, "xla_gpu_graph_min_graph_size": 1}


def pow2_at_least(n: int, cap: int) -> int:
    """Smallest power of two >= n, at most cap (cap itself when the power of two passes it)."""
    b = 1
    while b < n:
        b *= 2
    return min(b, cap)


@dataclasses.dataclass
class InFlight:
    """A dispatched decode_loop call whose tokens the host has not read yet."""
    rows: list[Optional[Request]]
    expect: list[int]              # tokens row i generates unless it stops first (0: padding)
    num_steps: int
    result: jax.Array              # decode_loop's packed result, on its way to the host
    last_tokens: jax.Array
    stopped: jax.Array
    t_dispatch: float


class FastDecoder:
    """Runs an LLM's decode steps as fused multi-step calls with overlapped scheduling (module docstring)."""

    def __init__(self, llm, *, multi_step: int, overlap: bool):
        if not isinstance(multi_step, int) or isinstance(multi_step, bool) or multi_step < 1:
            raise ValueError(f"multi_step must be an int >= 1 (decode steps per device call), got {multi_step!r}")
        self.llm = llm
        self.max_steps = multi_step
        self.overlap = bool(overlap)
        self.inflight: Optional[InFlight] = None
        self._last_collect = 0.0
        self._zeros: dict[int, tuple[jax.Array, jax.Array]] = {}
        # the xla backend's cost grows with the block table's width: size it by the pages in use
        self.bucket_block_table = llm.backend == "xla"
        leaves, treedef = jax.tree.flatten(llm.weights)
        self._weight_leaves = leaves
        graphdef, backend, interpret, ps, steps = llm.graphdef, llm.backend, llm.interpret, llm.page_size, multi_step
        plan = llm.sharding_plan

        def call(weight_leaves, caches, buf, prev_tokens, prev_stopped, *, layout):
            weights = jax.tree.unflatten(treedef, weight_leaves)
            caches, *out = decode_loop(graphdef, weights, from_stored(caches), buf, prev_tokens, prev_stopped,
                                       layout=layout, max_steps=steps, page_size=ps, backend=backend,
                                       interpret=interpret, plan=plan)
            return (as_stored(caches), *out)

        sharded = {}
        if plan is not None:
            # caches keep their layout across calls (donated in place); tokens and flags are read by the host
            rep = plan.replicated_sharding
            sharded["out_shardings"] = (jax.tree.map(lambda a: a.sharding, llm.caches), rep, rep, rep)
        self.fn = jax.jit(call, static_argnames=("layout",), donate_argnums=(1,),
                          compiler_options=decode_loop_compiler_options(jax.default_backend()), **sharded)

    # ---- one engine step -----------------------------------------------------------------------------------------
    def step(self) -> list[tuple[Request, int]]:
        llm = self.llm
        cur = self.inflight
        if cur is not None and not any(r is not None and r.status is Status.RUNNING for r in cur.rows):
            cur = self.inflight = None      # every row finished or was aborted: nothing to read (later calls queue)
        if cur is None:
            t_start = time.perf_counter()
            plan = llm.scheduler.schedule()
            if plan is None:
                return []
            if plan.kind != "decode":
                return llm._run_plan(plan, t_start)
            rows = llm._decode_rows(plan.decode)
            cur = self._dispatch_fresh(rows)
        self.inflight = self._continuation(cur) if self.overlap else None
        events = self._collect(cur)
        self.release_finished()
        return events

    def release_finished(self) -> None:
        """Forgets the in-flight call when none of its requests still runs (all stopped by eos / a stop token in
        the call before, or were aborted): nothing will read it, and holding it would keep finished requests alive
        until the next step. Its device work is wasted, never wrong: stopped rows write nothing."""
        nxt = self.inflight
        if nxt is not None and not any(r is not None and r.status is Status.RUNNING for r in nxt.rows):
            self.inflight = None

    # ---- planning ------------------------------------------------------------------------------------------------
    def _remaining(self, r: Request) -> int:
        """Tokens r may still generate before a length stop (Scheduler.check_stop's rule)."""
        return min(r.params.max_tokens - len(r.output_token_ids), self.llm.max_model_len - r.num_tokens)

    def _extra_pages(self, r: Request, first_pos: int, n: int) -> int:
        """Pages r needs beyond its own to write positions first_pos .. first_pos + n - 1."""
        return max(0, self.llm.allocator.pages_for(first_pos + n) - len(r.pages))

    def _take_pages(self, plan: list[tuple[Request, int, int]], k: int) -> bool:
        """Allocates, for every (request, first position, remaining) in plan, the pages of min(k, remaining)
        steps, if the pool has them all (each device's pool, with data-parallel attention); else allocates nothing
        and returns False."""
        alloc = self.llm.allocator
        needs = [(r, self._extra_pages(r, pos, min(k, rem))) for r, pos, rem in plan]
        pools: list[list] = []            # [pages of a sequence in the pool, pages wanted from that pool]
        for r, n in needs:
            pool = next((p for p in pools if alloc.shares_pool(p[0], r.pages)), None)
            if pool is None:
                pools.append([r.pages, n])
            else:
                pool[1] += n
        if not all(alloc.can_allocate(n, near=pages) for pages, n in pools):
            return False
        for r, n in needs:
            if n:
                r.pages += self.llm.allocator.allocate(n, near=r.pages)
        return True

    def _dispatch_fresh(self, rows: list[Optional[Request]]) -> InFlight:
        """A decode call for the Scheduler's batch (pages of its first step already allocated by it)."""
        live = [(r, r.num_tokens - 1, self._remaining(r)) for r in rows if r is not None]
        k = 1
        if self.max_steps > 1 and not self.llm.scheduler.waiting and self._take_pages(live, self.max_steps):
            k = self.max_steps
        return self._dispatch(rows, k, base={id(r): (pos, rem, 0) for r, pos, rem in live}, prev=None)

    def _continuation(self, cur: InFlight) -> Optional[InFlight]:
        """The call that continues `cur` on the device, dispatched now; None when it would not be what the plain
        path schedules next (module docstring)."""
        sched = self.llm.scheduler
        live = [r for r in cur.rows if r is not None]
        if any(r.status is not Status.RUNNING for r in live):
            return None                                     # aborted between calls
        if len(sched.running) != len(live) or {id(r) for r in sched.running} != {id(r) for r in live}:
            return None                                     # a request joined or is prefilling
        base, plan = {}, []
        for i, r in enumerate(cur.rows):
            if r is None:
                continue
            rem = self._remaining(r) - cur.expect[i]
            if rem > 0:                                     # else cur ends it by length
                pos = r.num_tokens - 1 + cur.expect[i]
                base[id(r)] = (pos, rem, cur.expect[i])
                plan.append((r, pos, rem))
        if not plan:
            return None
        if sched.waiting and len(plan) < sched.max_num_seqs:
            return None                                     # the plain path would try to admit first
        k = self.max_steps if not sched.waiting else 1
        if not self._take_pages(plan, k):
            if k == 1 or not self._take_pages(plan, 1):
                return None                                 # the plain path would preempt: go through it
            k = 1
        rows = [r if r is not None and id(r) in base else None for r in cur.rows]
        return self._dispatch(rows, k, base=base, prev=cur)

    # ---- device calls --------------------------------------------------------------------------------------------
    def _dispatch(self, rows: list[Optional[Request]], k: int, *, base: dict, prev: Optional[InFlight]) -> InFlight:
        """base: id(request) -> (first position, remaining tokens, tokens still in flight before this call)."""
        llm = self.llm
        B = len(rows)
        stops = [sorted(({*r.params.stop_token_ids} if r.params.stop_token_ids else set())
                        | (set() if r.params.ignore_eos else set(llm.eos_token_ids))) if r is not None else []
                 for r in rows]
        S = pow2_at_least(max(1, max(len(s) for s in stops)), 1 << 30)
        pages_used = max([len(r.pages) for r in rows if r is not None], default=1)
        W = pow2_at_least(pages_used, llm.block_table_width) if self.bucket_block_table else llm.block_table_width
        layout = InputLayout(B, W, S)
        f = dict(tokens=np.zeros(B, np.int32), prev_row=np.full(B, -1, np.int32), positions=np.zeros(B, np.int32),
                 remaining=np.zeros(B, np.int32), steps=np.zeros(B, np.int32), seeds=np.zeros(B, np.uint32),
                 temperature=np.zeros(B, np.float32), top_k=np.full(B, -1, np.int32),
                 top_p=np.ones(B, np.float32), stop_ids=np.full((B, S), -1, np.int32))
        expect = [0] * B
        for i, r in enumerate(rows):
            if r is None:
                continue
            pos, rem, ahead = base[id(r)]
            p = r.params
            f["positions"][i], f["remaining"][i], f["steps"][i] = pos, rem, len(r.output_token_ids) + ahead
            f["seeds"][i], f["temperature"][i], f["top_k"][i], f["top_p"][i] = r.seed, p.temperature, p.top_k, p.top_p
            f["stop_ids"][i, : len(stops[i])] = stops[i]
            if prev is not None:
                f["prev_row"][i] = i                        # continuations keep their rows
            else:
                f["tokens"][i] = r.last_token_id
            expect[i] = min(k, rem)
        f["block_table"] = paged.block_table([r.pages if r is not None else [] for r in rows], B, W)
        (buf,) = llm._put(pack_inputs(layout, k, **f))        # with a sharding plan: replicated over the mesh
        if prev is not None:
            prev_tokens, prev_stopped = prev.last_tokens, prev.stopped
        else:
            if B not in self._zeros:
                # device arrays placed as a previous call's outputs are: a NumPy or differently placed argument
                # here would compile the call a second time for its first continuation
                zeros = (jnp.zeros(B, jnp.int32), jnp.ones(B, bool))
                if llm.sharding_plan is not None:
                    zeros = jax.device_put(zeros, llm.sharding_plan.replicated_sharding)
                self._zeros[B] = zeros
            prev_tokens, prev_stopped = self._zeros[B]
        t = time.perf_counter()
        llm.caches, result, last, stopped = llm._programs.call(
            "decode_loop", self.fn, (layout, buf.shape, prev_tokens.shape), self._weight_leaves, llm.caches, buf,
            prev_tokens, prev_stopped, identity=f"/steps={self.max_steps}", layout=layout)
        if llm._decode_times is not None:             # benchmarks: the device call alone (no overlap then)
            jax.block_until_ready(result)
            dt = time.perf_counter() - t
            llm._decode_times.extend([(B, dt / k)] * k)
        else:
            result.copy_to_host_async()
        return InFlight(rows, expect, k, result, last, stopped, t)

    def _collect(self, cur: InFlight) -> list[tuple[Request, int]]:
        """Reads cur's tokens (waits for it), appends them step by step and finishes requests that stop."""
        llm, sched = self.llm, self.llm.scheduler
        tokens, logprobs, stopped = split_result(np.asarray(cur.result), self.max_steps)
        now = time.perf_counter()
        ran = max(1, int((tokens[: cur.num_steps] >= 0).any(axis=1).sum()))
        per_step = (now - max(cur.t_dispatch, self._last_collect)) / ran
        self._last_collect = now
        n_live = sum(r is not None for r in cur.rows)
        for _ in range(ran):
            llm.step_times.append(("decode", n_live, len(cur.rows), per_step))
        events = []
        active = [i for i, r in enumerate(cur.rows) if r is not None and r.status is Status.RUNNING]
        # Python ints and floats once per call, not a NumPy scalar per token (host time per token is what bounds
        # a large batch's step)
        tokens, logprobs = tokens[: cur.num_steps].tolist(), logprobs[: cur.num_steps].tolist()
        for j in range(cur.num_steps):
            still = []
            for i in active:
                r, t = cur.rows[i], tokens[j][i]
                if t < 0:
                    raise RuntimeError(f"decode loop: row {i} stopped on the device after {j} tokens but the host "
                                       f"expected more (request {r.request_id}); the device and host stop rules "
                                       "disagree")
                r.num_computed = r.num_tokens
                r.output_token_ids.append(t)
                r.output_logprobs.append(logprobs[j][i])
                events.append((r, t))
                reason = sched.check_stop(r, llm.eos_token_ids)
                if reason is not None:
                    sched.finish(r, reason)
                    r.finish_time = now
                elif j + 1 < cur.expect[i]:
                    still.append(i)
            active = still
            if not active:
                break
        return events

    def num_compiles(self) -> int:
        return self.llm._programs.count("decode_loop")
