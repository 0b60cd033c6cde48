"""Continuous-batching scheduler: admission, chunked prefill, decode batches, preemption by recompute.

Host-side bookkeeping only (no jax). Each engine step is either a prefill step (chunks of one or more prompts)
or a decode step (one token for every running request that finished its prefill). Requests join (admission)
and leave (finish) between steps.

Policy (vLLM V0-like, FIFO, no starvation):
- Admission: the oldest waiting request is admitted when fewer than max_num_seqs requests run and the pages for
  all of its tokens (prompt, plus the tokens it already generated if it was preempted) are free. Requests are
  never admitted out of order.
- Prefill and decode alternate while both have work, so long prompts (chunked to max_num_batched_tokens tokens
  per step) do not stall running requests for long.
- Decode: each request needs a page for the position of its newest token. When pages run out, the most
  recently admitted running request is preempted: its pages are freed and it returns to the front of the waiting
  queue; on re-admission its prompt plus generated tokens are prefilled again (recompute). Its random stream is
  keyed by (seed, number of tokens generated), so the tokens it samples are unchanged by preemption.
"""
from __future__ import annotations

import collections
import dataclasses
import enum
from typing import Optional

from .paged import PageAllocator
from .params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Request:
    request_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    prompt: Optional[str] = None
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    output_logprobs: list[float] = dataclasses.field(default_factory=list)
    pages: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0          # tokens whose latent is in the cache (positions 0..num_computed-1)
    status: Status = Status.WAITING
    finish_reason: Optional[str] = None
    error: Optional[Exception] = None
    num_preemptions: int = 0
    first_token_time: Optional[float] = None
    finish_time: Optional[float] = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def last_token_id(self) -> int:
        """all_token_ids[-1] without building that list."""
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def is_prefilling(self) -> bool:
        """True while tokens other than the newest sampled one still have to enter the cache by prefill.

        Before the first token: all prompt tokens. After a preemption: prompt + generated tokens except the last
        one, which the next decode step feeds (its logits give the next token)."""
        if not self.output_token_ids:
            return self.num_computed < len(self.prompt_token_ids)
        return self.num_computed < self.num_tokens - 1

    @property
    def prefill_target(self) -> int:
        """Number of tokens the prefill phase must put in the cache."""
        return len(self.prompt_token_ids) if not self.output_token_ids else self.num_tokens - 1


@dataclasses.dataclass
class PrefillChunk:
    request: Request
    start: int      # first position of the chunk
    length: int     # tokens in the chunk (>= 1)

    @property
    def completes_prefill(self) -> bool:
        return self.start + self.length == self.request.prefill_target

    @property
    def samples(self) -> bool:
        """Whether this chunk's last logits give a new token: only when it completes the prefill of a request
        that had not sampled before (a recomputed request's next token comes from the decode step that feeds its
        last sampled token)."""
        return self.completes_prefill and not self.request.output_token_ids


@dataclasses.dataclass
class SchedulerOutput:
    kind: str                                   # "prefill" | "decode"
    prefill: list[PrefillChunk] = dataclasses.field(default_factory=list)
    decode: list[Request] = dataclasses.field(default_factory=list)
    preempted: list[Request] = dataclasses.field(default_factory=list)


class Scheduler:
    def __init__(self, allocator: PageAllocator, *, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int):
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        if allocator.pages_for(max_model_len) > allocator.num_usable:
            raise ValueError(
                f"the KV cache has {allocator.num_usable} usable pages of {allocator.page_size} tokens, but one "
                f"sequence of max_model_len={max_model_len} tokens needs {allocator.pages_for(max_model_len)}; "
                "raise num_pages or lower max_model_len")
        self.allocator = allocator
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []           # in admission order
        self._last_kind: Optional[str] = None
        self.num_preemptions = 0

    # ---- queue -------------------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        request.status = Status.WAITING
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ----------------------------------------------------------------------------------------
    def schedule(self) -> Optional[SchedulerOutput]:
        self._admit()
        prefilling = [r for r in self.running if r.is_prefilling]
        decoding = [r for r in self.running if not r.is_prefilling]
        if prefilling and not (decoding and self._last_kind == "prefill"):
            out = SchedulerOutput("prefill", prefill=self._chunks(prefilling))
        elif decoding:
            out = self._decode_batch(decoding)
            if not out.decode:          # everything was preempted (cannot happen with >= 1 sequence of room)
                return self.schedule() if self.has_unfinished() else None
        else:
            return None
        self._last_kind = out.kind
        return out

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            need = self.allocator.pages_for(req.prefill_target)
            if not self.allocator.can_allocate(need):
                break
            self.waiting.popleft()
            req.pages = self.allocator.allocate(need)
            req.num_computed = 0
            req.status = Status.RUNNING
            self.running.append(req)

    def _chunks(self, prefilling: list[Request]) -> list[PrefillChunk]:
        budget = self.max_num_batched_tokens
        chunks = []
        for req in prefilling:
            if budget <= 0:
                break
            n = min(req.prefill_target - req.num_computed, budget)
            chunks.append(PrefillChunk(req, req.num_computed, n))
            budget -= n
        return chunks

    def _decode_batch(self, decoding: list[Request]) -> SchedulerOutput:
        out = SchedulerOutput("decode")
        for req in decoding:
            if req.status is not Status.RUNNING:       # preempted while making room for an earlier request
                continue
            # the step writes the newest token at position num_tokens - 1
            need = self.allocator.pages_for(req.num_tokens) - len(req.pages)
            while need > 0 and not self.allocator.can_allocate(need, near=req.pages):
                # the most recent request whose pages can make room for req (with data-parallel attention only
                # requests on req's device can; req itself always qualifies)
                victim = next(r for r in reversed(self.running) if self.allocator.shares_pool(r.pages, req.pages))
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            if req.status is not Status.RUNNING:
                continue
            if need > 0:
                req.pages += self.allocator.allocate(need, near=req.pages)
            out.decode.append(req)
        return out

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.allocator.free(req.pages)
        req.pages = []
        req.num_computed = 0
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # ---- results of a step -------------------------------------------------------------------------------
    def finish(self, req: Request, reason: str) -> None:
        req.finish_reason = reason
        req.status = Status.FINISHED
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:          # aborted while waiting (e.g. after a preemption)
            self.waiting.remove(req)
        if req.pages:
            self.allocator.free(req.pages)
            req.pages = []

    def check_stop(self, req: Request, eos_token_ids: frozenset[int]) -> Optional[str]:
        """Finish reason after the request's newest token, or None to continue."""
        p = req.params
        tok = req.output_token_ids[-1]
        if (not p.ignore_eos and tok in eos_token_ids) or (p.stop_token_ids and tok in p.stop_token_ids):
            return "stop"
        if len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return "length"
        return None
