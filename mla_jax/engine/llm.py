"""`mla_jax.LLM`: offline batched generation over a paged MLA KV cache (the engine).

    llm = LLM(path, dtype="bfloat16", kv_cache_dtype="auto", attention_backend="auto")
    outs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(max_tokens=32))

Each engine step is a prefill step (chunks of prompts, non-absorbed attention) or a decode step (one token for
every running request, absorbed MLA through pallas_kernels.mla_decode), chosen by the Scheduler; sampling runs on
the device in the same jitted call. Step shapes are padded to buckets (batch: powers of two up to max_num_seqs;
chunk: powers of two from 16 up to max_num_batched_tokens; prefix pages: powers of two up to the block-table
width), so a steady-state workload compiles nothing new.

Failures are per request: a prompt longer than max_model_len, an empty prompt or a token id outside the vocabulary
gives that request finish_reason "error" and a ValueError in RequestOutput.error; the other requests run
normally. Pass raise_on_error=True to generate() to have it raise the first such error after all requests ran.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import os
import time
from typing import Iterator, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from mla_jax import sharding
from mla_jax.checkpoint.files import read_generation_config, resolve_model_dir
from mla_jax.checkpoint.load import load_model
from mla_jax.checkpoint.sharded import load_sharded
from mla_jax.config import ModelConfig
from mla_jax.quant.awq import configure_w4a16
from pallas_kernels import resolve_backend
from . import paged
from .params import RequestOutput, SamplingParams
from .cache_storage import as_stored, stored_step
from .executables import ExecutableStore, default_directory
from .pools import DevicePagePools, decode_rows_by_device
from .runner import FastDecoder
from .sampling import sample
from .scheduler import Request, Scheduler
from .steps import allocate_caches, decode_step, prefill_step, split_model
from .text import IncrementalDetokenizer, Tokenizer

logger = logging.getLogger(__name__)

Prompt = Union[str, Sequence[int]]
KV_CACHE_DTYPES = ("auto", *pallas_kernels.CACHE_DTYPES)   # auto: the model dtype
MIN_CHUNK_BUCKET = 16




def _pow2_buckets(cap: int, start: int = 1) -> list[int]:
    """Powers of two from `start` below cap, then cap itself."""
    out, b = [], start
    while b < cap:
        out.append(b)
        b *= 2
    out.append(cap)
    return out


def _bucket(n: int, buckets: list[int]) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


class LLM:
    """Offline generation engine. Arguments as docs/architecture.md §8; engine knobs (keyword only):

    num_pages: KV-cache pages per layer including the scratch page (default: enough for max_num_seqs sequences of
        max_model_len tokens, capped by kv_cache_memory_bytes); tests set it small to force waiting/preemption.
    max_num_batched_tokens: prompt tokens per prefill step (the chunk size of chunked prefill), default 2048.
    page_size: tokens per page (64, FlashMLA's).
    kv_cache_memory_bytes: memory budget for the default num_pages (default: 90% of the device's free memory, or
        1 GiB where the device reports none, e.g. CPU).
    expert_dispatch, expert_capacity_factor: over several devices, how tokens reach the routed experts
        ("all_gather", the reference and default, or "all_to_all"; mla_jax.expert_parallel).
    fused_decode: decode through the fast path (engine/runner.py: sampling and stop checks fused into the step's
        jit, one transfer each way per call); False runs the plain path (one decode and one sampling call per
        step, tokens read every step). Same tokens either way. An engine spanning several processes
        (jax.distributed) uses the plain path.
    multi_step: with fused_decode, decode steps per device call while no request can join (default 8).
    overlap: with fused_decode, dispatch the next decode call before reading the current one's tokens.
    """

    def __init__(self, model: Union[str, os.PathLike], dtype: str = "bfloat16", kv_cache_dtype: str = "auto",
                 attention_backend: str = "auto", max_model_len: Optional[int] = None, max_num_seqs: int = 16,
                 tensor_parallel_size: int = 1, interpret: bool = False, seed: int = 0, *,
                 num_pages: Optional[int] = None, max_num_batched_tokens: int = 2048, page_size: int = 64,
                 kv_cache_memory_bytes: Optional[int] = None, data_parallel_attention: bool = False,
                 expert_dispatch: str = "all_gather", expert_capacity_factor: Optional[float] = None,
                 fused_decode: bool = True, multi_step: int = 8, overlap: bool = True):
        path = resolve_model_dir(model)       # a path, or the name of an embedded model ("tiny-deepseek-py")
        if not os.path.isdir(path):
            raise FileNotFoundError(f"model directory {path!r} does not exist (give an HF-format directory with "
                                    "config.json and *.safetensors, or one written by scripts/convert.py)")
        sharding_plan = None
        if tensor_parallel_size != 1 or data_parallel_attention:
            # each device reads only its slices of the checkpoint (mla_jax.checkpoint.sharded)
            sharding_plan = sharding.ShardingPlan.create(ModelConfig.from_pretrained(path), tensor_parallel_size,
                                                         data_parallel_attention, expert_dispatch=expert_dispatch,
                                                         expert_capacity_factor=expert_capacity_factor)
            loaded, cfg = load_sharded(path, sharding_plan, dtype=dtype)
        else:
            loaded, cfg = load_model(path, dtype=dtype)
        tokenizer = Tokenizer.from_dir(path)
        self._init(loaded, cfg, tokenizer=tokenizer, eos_token_ids=_eos_token_ids(path, cfg, tokenizer),
                   kv_cache_dtype=kv_cache_dtype, attention_backend=attention_backend, max_model_len=max_model_len,
                   max_num_seqs=max_num_seqs, tensor_parallel_size=tensor_parallel_size, interpret=interpret,
                   seed=seed, num_pages=num_pages, max_num_batched_tokens=max_num_batched_tokens,
                   page_size=page_size, kv_cache_memory_bytes=kv_cache_memory_bytes,
                   data_parallel_attention=data_parallel_attention, sharding_plan=sharding_plan,
                   fused_decode=fused_decode, multi_step=multi_step, overlap=overlap)

    @classmethod
    def from_model(cls, model, *, tokenizer=None, eos_token_ids: Sequence[int] = (), **kwargs) -> "LLM":
        """An engine over an already built model (e.g. random weights for benchmarks). kwargs as __init__ minus
        dtype (the model's own)."""
        self = cls.__new__(cls)
        cfg = model.cfg
        eos = set(eos_token_ids) | set(_as_tuple(cfg.eos_token_id))
        if tokenizer is not None:
            eos |= set(tokenizer.eos_token_ids)
        self._init(model, cfg, tokenizer=tokenizer, eos_token_ids=frozenset(eos), **kwargs)
        return self

    def _init(self, model, cfg, *, tokenizer, eos_token_ids, kv_cache_dtype="auto", attention_backend="auto",
              max_model_len=None, max_num_seqs=16, tensor_parallel_size=1, interpret=False, seed=0, num_pages=None,
              max_num_batched_tokens=2048, page_size=64, kv_cache_memory_bytes=None, data_parallel_attention=False,
              sharding_plan=None, expert_dispatch="all_gather", expert_capacity_factor=None, fused_decode=True,
              multi_step=8, overlap=True):
        # Several devices: weights, caches and the step functions' islands follow a mla_jax.sharding.ShardingPlan
        # (tensor-parallel attention, or data-parallel attention; experts split over devices in both).
        if sharding_plan is None and (tensor_parallel_size != 1 or data_parallel_attention):
            sharding_plan = sharding.ShardingPlan.create(cfg, tensor_parallel_size, data_parallel_attention,
                                                         expert_dispatch=expert_dispatch,
                                                         expert_capacity_factor=expert_capacity_factor)
        self.sharding_plan = sharding_plan
        dp_devices = sharding_plan.num_devices if sharding_plan and sharding_plan.data_parallel_attention else 1
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r}; choose one of {KV_CACHE_DTYPES}")
        if not isinstance(max_num_seqs, int) or max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be an int >= 1, got {max_num_seqs!r}")
        if not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be an int >= 0, got {seed!r}")
        self.model, self.cfg, self.tokenizer = model, cfg, tokenizer
        self.eos_token_ids = frozenset(int(i) for i in eos_token_ids)
        self.dtype = jnp.dtype(model.dtype)
        self.kv_cache_dtype = str(self.dtype) if kv_cache_dtype == "auto" else kv_cache_dtype
        if max_model_len is None:
            max_model_len = cfg.max_position_embeddings
        if not isinstance(max_model_len, int) or max_model_len < 1:
            raise ValueError(f"max_model_len must be an int >= 1, got {max_model_len!r}")
        if max_model_len > cfg.max_position_embeddings:
            raise ValueError(f"max_model_len={max_model_len} is larger than the model's max_position_embeddings="
                             f"{cfg.max_position_embeddings}; lower it")
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.page_size = page_size
        self.interpret = bool(interpret)
        self.seed = seed
        self._num_requests = 0
        self._live: dict[int, _LiveRequest] = {}      # add_request's requests until step() reports them finished
        self._live_ids = itertools.count()
        # (kind, requests in the step, padded rows, seconds from scheduling to sampled tokens on the host); prefill
        # steps that sample nothing are not waited for, so they are not recorded. For benchmarks.
        self.step_times: collections.deque = collections.deque(maxlen=1 << 16)
        self._decode_times: Optional[list] = None      # see record_decode_times

        # Backend: resolved once, logged once (pallas_kernels' INFO line); an impossible request raises here.
        self.backend, self.backend_reason = resolve_backend(attention_backend, self.kv_cache_dtype,
                                                            self.interpret)

        self.block_table_width = paged.cdiv(max_model_len, page_size)
        if num_pages is None:
            num_pages = self._default_num_pages(kv_cache_memory_bytes, dp_devices)
        if dp_devices > 1:
            # pages and decode rows split evenly over the devices; each sequence lives on one device
            sharding_plan.check_cache_size(num_pages, max_num_seqs)
            self.allocator = DevicePagePools(num_pages, page_size, dp_devices, max_num_seqs // dp_devices)
        else:
            self.allocator = paged.PageAllocator(num_pages, page_size)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.scheduler = Scheduler(self.allocator, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len)
        # AWQ layers: the w4a16 kernels, on each device's shards when the weights are split (shard_map islands)
        configure_w4a16(model, plan=sharding_plan)
        self.graphdef, self.weights = split_model(model)
        # fp8 latents rest as uint8 bits so the steps update them in place (engine/cache_storage.py); sharded
        # caches too: every step returns them stored, and a first call on float8 caches would compile each
        # shape twice (found as a prefill recompiling inside run_full_v3's timed run on 2 GPUs)
        if sharding_plan is None:
            self.caches = as_stored(allocate_caches(cfg, num_pages, page_size=page_size, dtype=self.kv_cache_dtype))
        else:   # each device allocates only its part of the caches; weights (and W_UK/W_UV) by the rules
            self.caches = as_stored(sharding.allocate_sharded(sharding_plan, lambda: allocate_caches(
                cfg, num_pages, page_size=page_size, dtype=self.kv_cache_dtype)))
            self.weights = sharding_plan.place_engine_weights(self.weights)

        self._batch_buckets = _pow2_buckets(max_num_seqs)
        self._device_batch_buckets = _pow2_buckets(max_num_seqs // dp_devices)
        self._chunk_buckets = _pow2_buckets(max(max_num_batched_tokens, MIN_CHUNK_BUCKET), MIN_CHUNK_BUCKET)
        self._prefix_buckets = [0] + _pow2_buckets(self.block_table_width)
        # One compiled program per shape bucket; the caches are donated (updated in place). Sampling is its own
        # program: its shapes depend only on the batch bucket, so prefill and decode share its variants. Programs
        # go through an ExecutableStore: resolved once per call signature, kept on disk when JAX's compilation
        # cache is on, and shared by every LLM of the process over an equal model (executables.py).
        graphdef, plan = self.graphdef, sharding_plan
        self._programs = ExecutableStore(self._program_identity(), default_directory())
        self._decode_fn = jax.jit(lambda w, c, *inputs: stored_step(decode_step)(
            graphdef, w, c, *inputs, backend=self.backend, interpret=self.interpret, plan=plan), donate_argnums=(1,))
        self._prefill_fn = jax.jit(lambda w, c, *inputs: stored_step(prefill_step)(graphdef, w, c, *inputs, plan=plan),
                                   donate_argnums=(1,))
        # sampled tokens are read by the host of every process: replicated
        self._sample_fn = (jax.jit(sample) if sharding_plan is None
                           else jax.jit(sample, out_shardings=sharding_plan.replicated_sharding))
        # the decode fast path (fused sampling, multi-step, overlap): one device, or a mesh within one process
        if not isinstance(fused_decode, bool) or not isinstance(overlap, bool):
            raise ValueError(f"fused_decode and overlap must be bools, got {fused_decode!r} and {overlap!r}")
        self._fast = None
        if fused_decode and (sharding_plan is None or jax.process_count() == 1):
            self._fast = FastDecoder(self, multi_step=multi_step, overlap=overlap)
        elif fused_decode:
            logger.info("LLM: the fused / multi-step / overlapped decode runs within one process; this engine spans "
                        "%d processes and decodes one step per call (fused_decode=False)", jax.process_count())
        logger.info("LLM: %d layers, dtype %s, kv cache %s x %d pages of %d tokens, backend %s, max_model_len %d, "
                    "max_num_seqs %d, chunk %d", cfg.num_hidden_layers, self.dtype, self.kv_cache_dtype, num_pages,
                    page_size, self.backend, max_model_len, max_num_seqs, max_num_batched_tokens)

    def _default_num_pages(self, budget: Optional[int], devices: int = 1) -> int:
        """devices > 1 (data-parallel attention): the budget is per device and each holds 1/devices of the
        pages, so the pool grows with the device count."""
        probe = pallas_kernels.MLAKVCache.allocate(1, page_size=self.page_size, dtype=self.kv_cache_dtype)
        page_bytes = sum(x.nbytes for x in jax.tree.leaves(probe)) * self.cfg.num_hidden_layers
        if budget is None:
            stats = jax.local_devices()[0].memory_stats() or {}
            if "bytes_limit" in stats:
                budget = int(0.9 * (stats["bytes_limit"] - stats.get("bytes_in_use", 0)))
            else:
                budget = 1 << 30
        want = self.max_num_seqs // devices * self.block_table_width + 1
        fit = budget // page_bytes
        if fit < self.block_table_width + 1:
            raise ValueError(f"the KV cache budget of {budget / 2**30:.2f} GiB holds {fit} pages of {page_bytes} B, "
                             f"but one sequence of max_model_len={self.max_model_len} needs "
                             f"{self.block_table_width} pages (+1 scratch); lower max_model_len or raise "
                             "kv_cache_memory_bytes / num_pages")
        if fit < want:
            logger.info("KV cache: %d pages fit in %.2f GiB (%d would hold max_num_seqs full-length sequences); "
                        "requests will wait or be preempted when pages run out", fit, budget / 2**30, want)
        return devices * int(min(want, fit))

    # ---- public --------------------------------------------------------------------------------------------
    def num_compiles(self) -> int:
        """Number of step programs (one per call signature) this engine has resolved so far, compiled or loaded
        from disk (steady state: stops growing). self._programs.stats says where they came from."""
        return len(self._programs)

    def program_stats(self) -> dict:
        """Where this engine's step programs came from: memory (another engine of the process), disk (a previous
        run), compiled; and written / not_written / load_errors (mla_jax/engine/executables.py)."""
        return dict(self._programs.stats)

    def _program_identity(self) -> str:
        """Everything the step programs depend on besides their arguments (executables.ExecutableStore); the
        decode loop adds its step count."""
        return repr((repr(self.graphdef), self.cfg, str(self.dtype), self.kv_cache_dtype, self.backend,
                     self.interpret, self.page_size, repr(self.sharding_plan)))

    def record_decode_times(self) -> list[tuple[int, float]]:
        """Starts timing the jitted decode step on its own: from now on each decode step waits for its logits
        before sampling (one extra sync) and appends (padded batch rows, seconds) to the returned list, which the
        caller may clear. On the fast path (fused_decode) each call is waited for and its time split evenly over
        the k steps it ran (one entry per step), which also turns overlap off while recording. For benchmarks:
        `step_times` also counts scheduling, input transfer and sampling."""
        self._decode_times = []
        return self._decode_times

    def generate(self, prompts: Union[Prompt, Sequence[Prompt]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None, *,
                 raise_on_error: bool = False) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. prompts: a str or a list of str (needs the model's tokenizer),
        or a list of token-id lists. sampling_params: one for all prompts or one per prompt."""
        outputs = None
        for event in self._run_requests(prompts, sampling_params, stream=False):
            outputs = event.outputs
        if raise_on_error:
            for o in outputs:
                o.raise_for_error()
        return outputs

    def generate_stream(self, prompts, sampling_params=None) -> Iterator["StreamEvent"]:
        """Yields a StreamEvent per generated token (index of the prompt, token id, text delta) and a last event
        whose `outputs` holds every RequestOutput in prompt order."""
        return self._run_requests(prompts, sampling_params, stream=True)

    def _run_requests(self, prompts, sampling_params, *, stream: bool) -> Iterator["StreamEvent"]:
        """generate_stream's generator; stream=False (generate) yields only the last event and skips the per-token
        work nobody reads (incremental detokenization, one event object per token): at batch 64 that work, ~25 µs
        a token on the H200's host, was most of a decode step (mla_jax/engine/NOTES.md)."""
        if self._live:
            raise RuntimeError(f"{len(self._live)} requests of add_request() are unfinished on this LLM; finish or "
                               "abort them (step() / abort_request()) before calling generate()")
        t0 = time.perf_counter()
        prompts, params = self._normalize(prompts, sampling_params)
        reqs: list[Request] = []
        failed: dict[int, Exception] = {}
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            prompt_text = prompt if isinstance(prompt, str) else None
            try:
                ids = self._tokenize(prompt)
                self._validate_prompt(ids)
            except ValueError as e:
                failed[i] = e
                ids = [] if not isinstance(prompt, (list, tuple)) else [int(t) for t in prompt if _is_int(t)]
            seed = sp.seed if sp.seed is not None else self._derived_seed()
            reqs.append(Request(i, ids, sp, seed=seed, prompt=prompt_text))
        detok = {}
        for r in reqs:
            if r.request_id in failed:
                r.finish_reason, r.error = "error", failed[r.request_id]
            elif r.params.max_tokens == 0:
                r.finish_reason = "length"
            else:
                self.scheduler.add(r)
                if self.tokenizer is not None and stream:
                    detok[r.request_id] = IncrementalDetokenizer(self.tokenizer)
        try:
            while self.scheduler.has_unfinished():
                events = self._step()
                if not stream:
                    now = None
                    for req, _ in events:
                        if req.first_token_time is None:
                            req.first_token_time = now = now or time.perf_counter()
                    continue
                # several tokens of one request may come in one step (multi-step decode): its finish_reason,
                # already set, belongs to its last event only
                last = {id(req): i for i, (req, _) in enumerate(events)}
                for i, (req, tok) in enumerate(events):
                    if req.first_token_time is None:
                        req.first_token_time = time.perf_counter()
                    reason = req.finish_reason if last[id(req)] == i else None
                    delta = detok[req.request_id].push(tok) if req.request_id in detok else ""
                    if reason is not None and req.request_id in detok:
                        delta += detok[req.request_id].flush()
                    yield StreamEvent(req.request_id, tok, delta, reason)
        except BaseException:
            self._abort_all()
            raise
        t1 = time.perf_counter()
        yield StreamEvent(None, None, "", None, outputs=[self._output(r, t0, t1) for r in reqs])

    # ---- incremental API (servers) ---------------------------------------------------------------------------
    # One request at a time: add_request() queues it, each step() runs one engine step over every unfinished
    # request (new ones join the running batch between steps: continuous batching) and reports the new tokens.
    # Not thread-safe: one thread owns the LLM and calls these (validate_prompt excepted).

    def validate_prompt(self, prompt: Prompt) -> list[int]:
        """The prompt's token ids, or a ValueError (TypeError for a wrong type) saying why it cannot run: empty,
        longer than max_model_len, ids outside the vocabulary, text without a tokenizer. Reads only the engine's
        fixed settings, so any thread may call it."""
        ids = self._tokenize(prompt)
        self._validate_prompt(ids)
        return ids

    def add_request(self, prompt: Prompt, sampling_params: Optional[SamplingParams] = None) -> int:
        """Queues one request and returns its id (unique for this LLM). Raises as validate_prompt for a prompt
        that cannot run (nothing is queued then)."""
        if sampling_params is None:
            sampling_params = SamplingParams()
        if not isinstance(sampling_params, SamplingParams):
            raise TypeError(f"sampling_params must be SamplingParams, got {type(sampling_params).__name__}")
        if len(self.scheduler.waiting) + len(self.scheduler.running) > len(self._live):
            raise RuntimeError("a generate() call is in progress on this LLM; add_request() cannot share it")
        ids = self.validate_prompt(prompt)
        seed = sampling_params.seed if sampling_params.seed is not None else self._derived_seed()
        request_id = next(self._live_ids)
        req = Request(request_id, ids, sampling_params, seed=seed, prompt=prompt if isinstance(prompt, str) else None)
        detok = IncrementalDetokenizer(self.tokenizer) if self.tokenizer is not None else None
        self._live[request_id] = _LiveRequest(req, detok)
        if sampling_params.max_tokens == 0:
            req.finish_reason = "length"        # reported by the next step(), with no token
        else:
            self.scheduler.add(req)
        return request_id

    def abort_request(self, request_id: int) -> bool:
        """Stops an unfinished request now and frees its KV-cache pages; step() reports nothing more for it.
        Returns False when the id is not an unfinished request (already finished, aborted or unknown)."""
        live = self._live.pop(request_id, None)
        if live is None:
            return False
        req = live.request
        if req.finish_reason is None:
            self.scheduler.finish(req, "abort")     # leaves the running or waiting queue, frees its pages
            if self._fast is not None:
                self._fast.release_finished()
        return True

    def has_unfinished(self) -> bool:
        """Whether step() has more to report for requests of add_request()."""
        return bool(self._live)

    def step(self) -> list["TokenEvent"]:
        """Runs one engine step and returns its TokenEvents in order (a request may get several). The last event
        of a request carries its finish_reason ("stop", "length"); the request is then forgotten."""
        events = []
        for request_id, live in list(self._live.items()):
            if live.request.finish_reason is not None and live.num_reported == 0:    # max_tokens=0
                del self._live[request_id]
                events.append(TokenEvent(request_id, None, None, "", live.request.finish_reason))
        if not self.scheduler.has_unfinished():
            return events
        produced = self._step()
        last_of = {id(req): i for i, (req, _) in enumerate(produced)}
        for i, (req, token) in enumerate(produced):
            live = self._live.get(req.request_id)
            if live is None or live.request is not req:      # aborted while its step ran
                continue
            n = live.num_reported
            if req.output_token_ids[n] != token:
                raise RuntimeError(f"request {req.request_id}: event token {token} is not output token {n} "
                                   f"({req.output_token_ids[n]}); _step() broke its contract")
            live.num_reported += 1
            text = live.detokenizer.push(token) if live.detokenizer is not None else ""
            finished = req.finish_reason is not None and last_of[id(req)] == i
            if finished:
                if live.detokenizer is not None:
                    text += live.detokenizer.flush()
                del self._live[req.request_id]
            events.append(TokenEvent(req.request_id, token, req.output_logprobs[n], text,
                                     req.finish_reason if finished else None))
        return events

    def stats(self) -> dict:
        """Scheduler and KV-cache occupancy now: requests running / waiting, KV pages in use / usable (all
        devices; the scratch pages excluded)."""
        usable = self.allocator.num_usable * getattr(self.allocator, "num_devices", 1)
        return {"running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
                "kv_pages_in_use": usable - self.allocator.num_free, "kv_pages_usable": usable}

    # ---- internals -------------------------------------------------------------------------------------------
    def _normalize(self, prompts, sampling_params):
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts and _is_int(prompts[0])):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts; give one for all "
                                 "or one per prompt")
            for p in params:
                if not isinstance(p, SamplingParams):
                    raise TypeError(f"sampling_params must be SamplingParams, got {type(p).__name__}")
        return prompts, params

    def _tokenize(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model directory has no tokenizer.json, so text prompts cannot be encoded; "
                                 "pass token-id lists instead")
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, (list, tuple, np.ndarray)):
            raise TypeError(f"a prompt must be a str or a list of token ids, got {type(prompt).__name__}")
        ids = [int(t) for t in np.asarray(prompt).reshape(-1)] if isinstance(prompt, np.ndarray) else list(prompt)
        bad = [t for t in ids if not _is_int(t) or not 0 <= int(t) < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:8]} are not ints in [0, vocab_size={self.cfg.vocab_size})")
        return [int(t) for t in ids]

    def _validate_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("the prompt is empty (0 tokens): the model needs at least one token to condition on "
                             "(e.g. the BOS token)")
        if len(ids) > self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens, longer than max_model_len={self.max_model_len}; "
                             "shorten it or raise max_model_len")

    def _derived_seed(self) -> int:
        self._num_requests += 1
        return int(np.random.SeedSequence([self.seed, self._num_requests]).generate_state(1)[0] & 0x7FFFFFFF)

    def _abort_all(self) -> None:
        for r in list(self.scheduler.running):
            self.scheduler.finish(r, "abort")
        self.scheduler.waiting.clear()
        if self._fast is not None:
            self._fast.release_finished()

    def _output(self, r: Request, t0: float, t1: float) -> RequestOutput:
        text = ""
        if self.tokenizer is not None and r.output_token_ids:
            text = self.tokenizer.decode(r.output_token_ids)
        metrics = {"time_to_first_token_s": None if r.first_token_time is None else r.first_token_time - t0,
                   "latency_s": (r.finish_time or t1) - t0}
        return RequestOutput(
            request_id=r.request_id, prompt=r.prompt, prompt_token_ids=list(r.prompt_token_ids),
            token_ids=list(r.output_token_ids), text=text,
            logprobs=list(r.output_logprobs) if r.params.logprobs else None,
            finish_reason=r.finish_reason, error=r.error, num_preemptions=r.num_preemptions, metrics=metrics)

    def _sampling_arrays(self, rows: list[Optional[Request]], n: int):
        temperature = np.zeros(n, np.float32)
        top_k = np.full(n, -1, np.int32)
        top_p = np.ones(n, np.float32)
        seeds = np.zeros(n, np.uint32)
        steps = np.zeros(n, np.int32)
        for i, r in enumerate(rows):
            if r is None:
                continue
            p = r.params
            temperature[i], top_k[i], top_p[i] = p.temperature, p.top_k, p.top_p
            seeds[i], steps[i] = r.seed, len(r.output_token_ids)
        return temperature, top_k, top_p, seeds, steps

    def _put(self, *arrays):
        """Host step inputs as jit arguments: as they are on one device; with a sharding plan, replicated global
        arrays (jit refuses host arrays when the mesh spans several processes)."""
        if self.sharding_plan is None:
            return arrays
        return sharding.put_global(self.sharding_plan, arrays)

    def _decode_rows(self, reqs: list[Request]) -> list[Optional[Request]]:
        """The decode batch's rows (None = padding), padded to a batch bucket. With data-parallel attention each
        device's requests fill that device's block of rows (pools.decode_rows_by_device)."""
        if isinstance(self.allocator, DevicePagePools):
            return decode_rows_by_device(reqs, self.allocator, self._device_batch_buckets)
        B = _bucket(len(reqs), self._batch_buckets)
        return list(reqs) + [None] * (B - len(reqs))

    def _step(self) -> list[tuple[Request, int]]:
        """One engine step: (request, token) for every token generated, in order (several per request with
        multi-step decode); a finished request's finish_reason is set when the call returns, and its last event in
        the list is its last token. Call while scheduler.has_unfinished()."""
        if self._fast is not None:
            return self._fast.step()
        t_start = time.perf_counter()
        plan = self.scheduler.schedule()
        if plan is None:
            return []
        return self._run_plan(plan, t_start)

    def _run_plan(self, plan, t_start: float) -> list[tuple[Request, int]]:
        """The plain path's step for a Scheduler plan (prefill, or decode with a separate sampling call)."""
        ps = self.page_size
        if plan.kind == "decode":
            reqs = plan.decode
            rows = self._decode_rows(reqs)
            B = len(rows)
            tokens = np.zeros(B, np.int32)
            positions = np.zeros(B, np.int32)
            slot = np.full(B, -1, np.int32)       # -1: padding rows write nothing
            seq_lens = np.zeros(B, np.int32)
            for i, r in enumerate(rows):
                if r is None:
                    continue
                pos = r.num_tokens - 1
                tokens[i], positions[i], seq_lens[i] = r.last_token_id, pos, pos + 1
                slot[i] = paged.slots(r.pages, [pos], ps)[0]
            bt = paged.block_table([r.pages if r is not None else [] for r in rows], B, self.block_table_width)
            samp = self._sampling_arrays(rows, B)
            inputs = self._put(tokens, positions, slot, bt, seq_lens)
            t_decode = time.perf_counter()
            self.caches, logits = self._programs.call("decode", self._decode_fn, tuple(x.shape for x in inputs),
                                                      self.weights, self.caches, *inputs)
            if self._decode_times is not None:
                jax.block_until_ready(logits)
                self._decode_times.append((B, time.perf_counter() - t_decode))
            for r in reqs:
                r.num_computed = r.num_tokens
            sampled = reqs
            row_of = {id(r): i for i, r in enumerate(rows) if r is not None}
        else:
            chunks = plan.prefill
            N = _bucket(len(chunks), self._batch_buckets)
            C = _bucket(max(c.length for c in chunks), self._chunk_buckets)
            P = _bucket(max(paged.cdiv(c.start, ps) for c in chunks), self._prefix_buckets)
            tokens = np.zeros((N, C), np.int32)
            positions = np.zeros((N, C), np.int32)
            slot = np.full((N, C), -1, np.int32)
            prefix_lens = np.zeros(N, np.int32)
            chunk_lens = np.zeros(N, np.int32)
            for i, c in enumerate(chunks):
                r, pos = c.request, np.arange(c.start, c.start + c.length)
                tokens[i, : c.length] = r.all_token_ids[c.start: c.start + c.length]
                positions[i, : c.length] = pos
                slot[i, : c.length] = paged.slots(r.pages, pos, ps)
                prefix_lens[i], chunk_lens[i] = c.start, c.length
            bt = paged.block_table([c.request.pages[:P] for c in chunks], N, P)
            rows = [c.request if c.samples else None for c in chunks]
            samp = self._sampling_arrays(rows, N)
            inputs = self._put(tokens, positions, slot, bt, prefix_lens, chunk_lens)
            self.caches, logits = self._programs.call("prefill", self._prefill_fn, (N, C, P), self.weights,
                                                      self.caches, *inputs)
            for c in chunks:
                c.request.num_computed += c.length
            sampled = [c.request for c in chunks if c.samples]
            row_of = {id(c.request): i for i, c in enumerate(chunks)}
        if not sampled:
            return []
        tok, lp = self._programs.call("sample", self._sample_fn, (logits.shape, logits.dtype), logits,
                                      *self._put(*samp))
        tok, lp = jax.device_get((tok, lp))        # one transfer for both
        n_rows = len(tokens)
        self.step_times.append((plan.kind, len(row_of), n_rows, time.perf_counter() - t_start))
        events = []
        now = time.perf_counter()
        for r in sampled:
            i = row_of[id(r)]
            t = int(tok[i])
            r.output_token_ids.append(t)
            r.output_logprobs.append(float(lp[i]))
            reason = self.scheduler.check_stop(r, self.eos_token_ids)
            if reason is not None:
                self.scheduler.finish(r, reason)
                r.finish_time = now
            events.append((r, t))
        return events


class StreamEvent:
    """One generated token of request `index` (token_id, text delta, finish_reason once it finished), or — the
    last event of a stream — index None and `outputs` = every RequestOutput in prompt order."""

    __slots__ = ("index", "token_id", "text", "finish_reason", "outputs")

    def __init__(self, index, token_id, text, finish_reason, outputs=None):
        self.index, self.token_id, self.text, self.finish_reason, self.outputs = (
            index, token_id, text, finish_reason, outputs)

    def __repr__(self):
        return (f"StreamEvent(index={self.index}, token_id={self.token_id}, text={self.text!r}, "
                f"finish_reason={self.finish_reason})")


@dataclasses.dataclass(frozen=True)
class TokenEvent:
    """One token of request `request_id` from LLM.step(): its id, log-probability under the model (before
    temperature / top-k / top-p), text delta (complete UTF-8 only; "" without a tokenizer), and finish_reason on
    the request's last event. token_id and logprob are None for a request that finished without a token
    (max_tokens=0)."""

    request_id: int
    token_id: Optional[int]
    logprob: Optional[float]
    text: str
    finish_reason: Optional[str]


@dataclasses.dataclass
class _LiveRequest:
    request: Request
    detokenizer: Optional[IncrementalDetokenizer]
    num_reported: int = 0          # tokens step() reported so far


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _as_tuple(x) -> tuple:
    if x is None:
        return ()
    return tuple(x) if isinstance(x, (list, tuple)) else (x,)


def _eos_token_ids(path: str, cfg, tokenizer) -> frozenset:
    """eos ids from the tokenizer (tokenizer_config + generation_config), or without one from
    generation_config.json, plus config.json's eos_token_id."""
    eos = set(_as_tuple(cfg.eos_token_id))
    if tokenizer is not None:
        eos |= set(tokenizer.eos_token_ids)
    else:
        eos |= set(_as_tuple(read_generation_config(path).get("eos_token_id")))
    return frozenset(int(i) for i in eos)
