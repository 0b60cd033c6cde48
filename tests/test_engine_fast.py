"""The decode fast path (engine/runner.py, engine/decode_loop.py) against the plain path.

fp32 model + fp32 cache + xla backend (the v3_yarn fixture, as tests/test_engine_hf.py): fused sampling, multi-step
decode (k = 4 and 8) and overlapped scheduling must give the plain path's tokens, logprobs and finish reasons,
with prompts of different lengths, prefill in 8-token chunks, a pool small enough to force preemption, stop
tokens and length limits that fall inside a multi-step call, seeded sampling, and requests added or aborted
between engine steps while a call is in flight.
"""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mla_jax.engine import cache_storage
from mla_jax.engine.decode_loop import InputLayout, _unpack, pack_inputs
from mla_jax.engine.llm import LLM
from mla_jax.engine.params import SamplingParams
from mla_jax.engine.paged import PageAllocator
from mla_jax.engine.scheduler import Request, Scheduler
from pallas_kernels import MLAKVCache
from pallas_kernels.mla_decode.cache import dequantize_fp8, quantize_fp8

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
PAGE_SIZE = 4


def golden():
    with open(os.path.join(FIXTURES, "v3_yarn", "generate_golden.json")) as f:
        return json.load(f)


def engine(**kw):
    """fp32/xla engine whose pool holds one full sequence + 4 pages, prefill in 8-token chunks."""
    g = golden()
    max_model_len = max(len(p) for p in g["prompts"]) + g["max_new_tokens"] + 3
    pages_one_seq = -(-max_model_len // PAGE_SIZE)
    kw = dict(dtype="float32", kv_cache_dtype="auto", attention_backend="xla", max_model_len=max_model_len,
              max_num_seqs=4, page_size=PAGE_SIZE, num_pages=pages_one_seq + 4, max_num_batched_tokens=8) | kw
    return LLM(os.path.join(FIXTURES, "v3_yarn"), **kw)


MODES = {"plain": dict(fused_decode=False), "overlap_k1": dict(multi_step=1, overlap=True), "overlap_k4": dict(multi_step=4, overlap=True),
         "k8_no_overlap": dict(multi_step=8, overlap=False)}


@pytest.fixture(scope="module")
def engines():
    return {name: engine(**kw) for name, kw in MODES.items()}


def same_outputs(got, want, atol=1e-5):
    for i, (o, w) in enumerate(zip(got, want)):
        assert o.finish_reason == w.finish_reason, (i, o.finish_reason, w.finish_reason)
        assert o.token_ids == w.token_ids, f"request {i}: {o.token_ids} != {w.token_ids}"
        if w.logprobs is not None:
            np.testing.assert_allclose(o.logprobs, w.logprobs, atol=atol, rtol=0, err_msg=f"request {i}")


@pytest.mark.parametrize("mode", [m for m in MODES if m != "plain"])
def test_greedy_matches_plain_path_with_preemption(engines, mode):
    g = golden()
    params = SamplingParams(max_tokens=g["max_new_tokens"], ignore_eos=True, logprobs=True)
    plain = engines["plain"]
    want = plain.generate(g["prompts"], params)
    llm = engines[mode]
    before = llm.scheduler.num_preemptions
    got = llm.generate(g["prompts"], params)
    same_outputs(got, want)
    for o, ids in zip(got, g["token_ids"]):          # and HF's greedy continuation
        assert o.token_ids == ids
    assert llm.scheduler.num_preemptions > before    # the pool ran out: requests were preempted and recomputed
    assert llm.allocator.num_free == llm.allocator.num_usable


def test_stops_and_lengths_inside_a_multi_step_call(engines):
    """Stop tokens, eos and max_tokens that end requests in the middle of a k-step call; the other requests
    go on; different max_tokens per request."""
    g = golden()
    prompts, ids = g["prompts"], g["token_ids"]
    saved = {n: e.eos_token_ids for n, e in engines.items()}
    params = [SamplingParams(max_tokens=12, stop_token_ids=[ids[0][6]], logprobs=True),     # stops at step ~6
              SamplingParams(max_tokens=3, ignore_eos=True, logprobs=True),                 # length, mid-call
              SamplingParams(max_tokens=11, logprobs=True),                                 # eos (set below)
              SamplingParams(max_tokens=9, ignore_eos=True, logprobs=True)][: len(prompts)]
    results = {}
    try:
        for name in ("plain", "overlap_k4", "k8_no_overlap"):
            e = engines[name]
            e.eos_token_ids = frozenset({ids[2][4]})
            results[name] = e.generate(prompts[: len(params)], params)
    finally:
        for n, e in engines.items():
            e.eos_token_ids = saved[n]
    want = results["plain"]
    assert want[0].finish_reason == "stop" and len(want[0].token_ids) < 12
    assert want[1].finish_reason == "length" and len(want[1].token_ids) == 3
    assert want[2].finish_reason == "stop" and want[2].token_ids[-1] == ids[2][4]
    for name in ("overlap_k4", "k8_no_overlap"):
        same_outputs(results[name], want)
        assert engines[name].allocator.num_free == engines[name].allocator.num_usable


def test_seeded_sampling_matches_plain_path(engines):
    g = golden()
    params = [SamplingParams(temperature=1.0, top_p=0.9, top_k=20, max_tokens=10, ignore_eos=True, seed=7,
                             logprobs=True),
              SamplingParams(temperature=0.7, max_tokens=8, ignore_eos=True, seed=3, logprobs=True),
              SamplingParams(max_tokens=10, ignore_eos=True, logprobs=True)]
    want = engines["plain"].generate(g["prompts"][:3], params)
    got = engines["overlap_k4"].generate(g["prompts"][:3], params)
    same_outputs(got, want)


def drive(llm, reqs, *, abort_after=None, add_after=None):
    """Runs requests through LLM._step as a server would: the events of each call; `abort_after` = (n, request):
    abort that request once n calls returned; `add_after` = (n, request): add it then."""
    for r in reqs:
        llm.scheduler.add(r)
    events, calls = [], 0
    while llm.scheduler.has_unfinished():
        got = llm._step()
        calls += 1
        events += got
        if abort_after and calls == abort_after[0]:
            llm.scheduler.finish(abort_after[1], "abort")
        if add_after and calls == add_after[0]:
            llm.scheduler.add(add_after[1])
    return events


def test_abort_and_add_between_calls_while_a_call_is_in_flight(engines):
    g = golden()
    p = SamplingParams(max_tokens=10, ignore_eos=True, logprobs=True)

    def reqs(seed0):
        return [Request(seed0 + i, list(g["prompts"][i]), p, seed=i) for i in range(3)]

    plain = engines["plain"]
    want = reqs(100)
    drive(plain, want)
    llm = engines["overlap_k1"]                     # k = 1: a continuation is in flight after every decode call
    got = reqs(200)
    late = Request(300, list(g["prompts"][3 % len(g["prompts"])]), p, seed=5)
    events = drive(llm, got, abort_after=(4, got[1]), add_after=(5, late))
    assert llm._fast.inflight is None or all(r is None or r.status.value == "finished"
                                             for r in llm._fast.inflight.rows)
    # the aborted request got no token after its abort; the others are the plain path's
    n_aborted = len(got[1].output_token_ids)
    assert got[1].finish_reason == "abort" and n_aborted < 10
    assert sum(1 for r, _ in events if r is got[1]) == n_aborted
    for a, b in ((got[0], want[0]), (got[2], want[2])):
        assert a.output_token_ids == b.output_token_ids and a.finish_reason == "length"
        np.testing.assert_allclose(a.output_logprobs, b.output_logprobs, atol=1e-5)
    assert got[1].output_token_ids == want[1].output_token_ids[:n_aborted]
    alone = Request(301, list(late.prompt_token_ids), p, seed=5)
    drive(plain, [alone])
    assert late.output_token_ids == alone.output_token_ids
    assert llm.allocator.num_free == llm.allocator.num_usable


def test_no_recompilation_in_steady_state_fast_path(engines):
    g = golden()
    llm = engines["overlap_k4"]
    p = SamplingParams(max_tokens=6, ignore_eos=True)
    llm.generate(g["prompts"], p)
    n = llm.num_compiles()
    llm.generate(g["prompts"], [SamplingParams(max_tokens=6, temperature=0.5, seed=1), p, p, p][: len(g["prompts"])])
    assert llm.num_compiles() == n


def test_packed_inputs_round_trip():
    rng = np.random.default_rng(0)
    layout = InputLayout(batch=3, width=5, stop_slots=2)
    fields = dict(tokens=rng.integers(0, 9, 3), prev_row=np.array([-1, 0, 2]), positions=rng.integers(0, 9, 3),
                  remaining=rng.integers(0, 9, 3), steps=rng.integers(0, 9, 3),
                  seeds=np.array([0, 2**31 + 5, 2**32 - 1], np.uint32), temperature=rng.random(3).astype(np.float32),
                  top_k=np.array([-1, 3, 0]), top_p=rng.random(3).astype(np.float32),
                  stop_ids=rng.integers(-1, 9, (3, 2)), block_table=rng.integers(0, 20, (3, 5)))
    buf = pack_inputs(layout, 7, **fields)
    assert buf.dtype == np.int32 and buf.shape == (layout.size,)
    num_steps, out = jax.jit(lambda b: _unpack(layout, b))(jnp.asarray(buf))
    assert int(num_steps) == 7
    for name, want in fields.items():
        got = np.asarray(out[name])
        assert got.dtype == np.asarray(want).dtype or got.dtype == np.int32, name
        np.testing.assert_array_equal(got, np.asarray(want).astype(got.dtype), err_msg=name)
    with pytest.raises(ValueError, match="block_table"):
        pack_inputs(layout, 1, **(fields | dict(block_table=np.zeros((3, 4), np.int32))))


def test_fp8_stored_form_round_trips_and_writes_in_place():
    cache = MLAKVCache.allocate(6, page_size=4, dtype="fp8_e4m3")
    rng = np.random.default_rng(1)
    lat = jnp.asarray(rng.standard_normal((3, 512)), jnp.float32)
    rope = jnp.asarray(rng.standard_normal((3, 64)), jnp.float32)
    slots = jnp.asarray([5, -1, 17], jnp.int32)
    want = cache.write(slots, lat, rope)
    stored = cache_storage.as_stored((cache,))
    assert stored[0].latent.dtype == jnp.uint8
    step = jax.jit(lambda s: cache_storage.as_stored((cache_storage.from_stored(s)[0].write(slots, lat, rope),)),
                   donate_argnums=0)
    got = cache_storage.from_stored(step(stored))[0]
    assert got.latent.dtype == jnp.float8_e4m3fn
    for a, b in ((got.latent, want.latent), (got.rope, want.rope), (got.scale, want.scale)):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8) if a.dtype == jnp.float8_e4m3fn else a,
                                      np.asarray(b).view(np.uint8) if b.dtype == jnp.float8_e4m3fn else b)
    # the uint8-bit scatter wrote the same values a float8 scatter writes
    ref = np.zeros((6 * 4, 512), np.float32)
    q, s = quantize_fp8(lat)
    deq = np.asarray(dequantize_fp8(q, s))
    ref[5], ref[17] = deq[0], deq[2]
    got_deq = np.asarray(got.dequantize()[0]).reshape(-1, 512)
    np.testing.assert_array_equal(got_deq, ref)


def test_stream_reports_finish_on_the_last_event_only(engines):
    """Multi-step returns several tokens of a request from one step: only its last event carries finish_reason,
    and the streamed tokens are the request's tokens."""
    g = golden()
    llm = engines["overlap_k4"]
    params = [SamplingParams(max_tokens=7, ignore_eos=True), SamplingParams(max_tokens=10, ignore_eos=True)]
    events = list(llm.generate_stream(g["prompts"][:2], params))
    outs = events[-1].outputs
    for i, o in enumerate(outs):
        mine = [e for e in events[:-1] if e.index == i]
        assert [e.token_id for e in mine] == o.token_ids and len(mine) == params[i].max_tokens
        assert [e.finish_reason for e in mine] == [None] * (len(mine) - 1) + ["length"]


def test_aborting_a_waiting_request_removes_it_from_the_queue():
    sched = Scheduler(PageAllocator(8, 4), max_num_seqs=1, max_num_batched_tokens=8, max_model_len=16)
    a, b = (Request(i, [3, 4, 5], SamplingParams(max_tokens=4), seed=i) for i in range(2))
    sched.add(a)
    sched.add(b)
    assert sched.schedule().prefill[0].request is a          # b waits (one sequence at a time)
    sched.finish(b, "abort")
    assert list(sched.waiting) == [] and b.finish_reason == "abort"
    sched.finish(a, "abort")
    assert not sched.has_unfinished() and sched.allocator.num_free == sched.allocator.num_usable


def test_finished_or_aborted_requests_are_not_kept_by_an_in_flight_call(engines):
    """An overlapped continuation whose requests all stopped (eos, stop token, abort) is forgotten: nothing reads
    it, and it must not keep finished requests alive until some later step."""
    import gc
    llm = engines["overlap_k1"]
    g = golden()
    ids = [llm.add_request(list(p), SamplingParams(max_tokens=g["max_new_tokens"], ignore_eos=True))
           for p in g["prompts"][:2]]
    for _ in range(20):                                   # through prefill, until a continuation is on the device
        llm.step()
        if llm._fast.inflight is not None:
            break
    assert llm._fast.inflight is not None and llm.has_unfinished()
    for i in ids:
        assert llm.abort_request(i)
    assert llm._fast.inflight is None
    gc.collect()
    assert not [o for o in gc.get_objects() if isinstance(o, Request) and o.request_id in ids
                and o.finish_reason == "abort"]


def test_generate_equals_the_stream_it_no_longer_builds():
    """generate() skips the per-token stream (incremental detokenization, one event per token); its outputs must
    equal generate_stream()'s last event, whose text deltas join to the same text (embedded model, text prompts,
    multi-step with overlap)."""
    path = os.path.join(os.path.dirname(__file__), "..", "checkpoints", "tiny-deepseek-py")
    llm = LLM(path, max_num_seqs=4, max_model_len=96, attention_backend="xla", multi_step=4, seed=0)
    prompts = ["import os", "def f(x):\n    return", "class A:", "for i in range(10):"]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (5, 12, 1, 9)]
    outs = llm.generate(prompts, params)
    events = list(llm.generate_stream(prompts, params))
    streamed = events[-1].outputs
    same_outputs(outs, streamed)
    for i, (o, s) in enumerate(zip(outs, streamed)):
        assert o.text == s.text and len(o.token_ids) == params[i].max_tokens
        assert "".join(e.text for e in events[:-1] if e.index == i) == o.text
        assert o.metrics["time_to_first_token_s"] is not None and o.metrics["time_to_first_token_s"] > 0


def test_decode_loop_is_one_cuda_graph_on_gpus_unless_the_user_set_command_buffers():
    from mla_jax.engine.runner import GPU_LOOP_COMMAND_BUFFERS, decode_loop_compiler_options
    opts = decode_loop_compiler_options("gpu", xla_flags="--xla_gpu_autotune_level=0")
    assert opts["xla_gpu_enable_command_buffer"] == GPU_LOOP_COMMAND_BUFFERS
    assert {"WHILE", "CONDITIONAL"} <= set(GPU_LOOP_COMMAND_BUFFERS.split(","))
    assert decode_loop_compiler_options("cpu", xla_flags="") is None
    assert decode_loop_compiler_options("gpu", xla_flags="--xla_gpu_enable_command_buffer=FUSION") is None
    # XLA accepts every name in the list (a misspelt type fails at compile time, so compile something with it)
    f = jax.jit(lambda x: x + 1, compiler_options={"xla_gpu_enable_command_buffer": GPU_LOOP_COMMAND_BUFFERS})
    assert float(f(jnp.float32(1))) == 2.0


def test_multi_step_pages_are_checked_per_device_pool_with_data_parallel_attention():
    """With data-parallel attention a sequence grows only inside its device's pool: k steps go ahead only if every
    device has the pages its own sequences need, and a refusal allocates nothing."""
    from types import SimpleNamespace
    from mla_jax.engine.pools import DevicePagePools
    from mla_jax.engine.runner import FastDecoder
    pools = DevicePagePools(num_pages=16, page_size=4, num_devices=2, max_seqs_per_device=4)
    a = SimpleNamespace(pages=pools.allocate(6))            # device with the most free pages: 0 (tie -> lowest)
    b = SimpleNamespace(pages=pools.allocate(1))            # now device 1
    assert (pools.device_of(a.pages), pools.device_of(b.pages)) == (0, 1)
    assert (pools.num_free_on(0), pools.num_free_on(1), pools.num_free) == (1, 6, 7)
    fd = FastDecoder.__new__(FastDecoder)
    fd.llm = SimpleNamespace(allocator=pools)
    # a's next 8 tokens (positions 24..31) need 2 more pages on device 0, which has 1: refused, though the two
    # pools together have 7
    assert not fd._take_pages([(a, 24, 100), (b, 3, 100)], 8)
    assert (len(a.pages), len(b.pages), pools.num_free_on(0), pools.num_free_on(1)) == (6, 1, 1, 6)
    # 4 steps: a needs 1 page (device 0 has it), b 1 (device 1)
    assert fd._take_pages([(a, 24, 100), (b, 3, 100)], 4)
    assert (len(a.pages), len(b.pages), pools.num_free_on(0), pools.num_free_on(1)) == (7, 2, 0, 5)
    assert pools.device_of(a.pages) == 0 and pools.device_of(b.pages) == 1


def test_a_continuation_reuses_the_first_calls_compiled_variant():
    """The first call of a batch and the calls that continue it on the device (overlap) have the same layout and
    must share one compiled variant: the first call's 'previous tokens' are placed as a call's outputs are."""
    llm = engine(multi_step=4, overlap=True, max_model_len=64, num_pages=40)
    fd = llm._fast
    continued = []
    dispatch = fd._dispatch

    def spy(rows, k, *, base, prev):
        continued.append(prev is not None)
        return dispatch(rows, k, base=base, prev=prev)

    fd._dispatch = spy
    before = fd.num_compiles()
    # 20 prompt tokens + 12 new ones stay within a block table of 8 pages of 4: one layout for every call
    out = llm.generate([list(range(3, 23))], SamplingParams(max_tokens=12, ignore_eos=True))
    assert len(out[0].token_ids) == 12
    assert continued[0] is False and any(continued[1:]), continued
    assert fd.num_compiles() - before == 1
