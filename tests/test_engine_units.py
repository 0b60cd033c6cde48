"""Unit tests of the engine's host-side parts and on-device sampling (no model needed)."""
import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mla_jax.engine.paged import SCRATCH_PAGE, PageAllocator, block_table, slots
from mla_jax.engine.params import RequestOutput, SamplingParams
from mla_jax.engine.sampling import sample
from mla_jax.engine.scheduler import Request, Scheduler, Status


# ---------------------------------------------------------------- SamplingParams
@pytest.mark.parametrize("kwargs, word", [
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature="1"), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(top_k=2.0), "top_k"),
    (dict(max_tokens=-1), "max_tokens"),
    (dict(max_tokens=1.5), "max_tokens"),
    (dict(stop_token_ids=[1, -3]), "stop_token_ids"),
    (dict(stop_token_ids="12"), "stop_token_ids"),
    (dict(seed=-1), "seed"),
    (dict(seed=2**40), "seed"),
    (dict(logprobs=1), "logprobs"),
    (dict(ignore_eos="yes"), "ignore_eos"),
])
def test_sampling_params_reject_bad_values(kwargs, word):
    with pytest.raises(ValueError, match=word):
        SamplingParams(**kwargs)


def test_sampling_params_defaults_and_normalisation():
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens, p.stop_token_ids, p.ignore_eos, p.logprobs, p.seed) == (
        0.0, 1.0, -1, 16, None, False, False, None)
    assert p.greedy
    q = SamplingParams(temperature=1, stop_token_ids=[3, 4], max_tokens=0, top_k=0)
    assert q.stop_token_ids == (3, 4) and isinstance(q.temperature, float) and not q.greedy
    hash(q)  # frozen -> usable as a dict key


def test_request_output_error():
    err = ValueError("too long")
    out = RequestOutput(0, None, [1], [], "", None, "error", error=err)
    with pytest.raises(ValueError, match="too long"):
        out.raise_for_error()
    ok = RequestOutput(1, None, [1], [2], "", None, "length")
    assert ok.raise_for_error() is ok and ok.finished


# ---------------------------------------------------------------- pages
def test_allocator_never_hands_out_scratch_or_twice():
    a = PageAllocator(9, 4)
    assert a.num_usable == 8 and a.num_free == 8
    got = a.allocate(5)
    assert SCRATCH_PAGE not in got and len(set(got)) == 5
    assert not a.can_allocate(4)
    with pytest.raises(RuntimeError, match="out of KV-cache pages"):
        a.allocate(4)
    a.free(got[:2])
    more = a.allocate(5)
    assert not set(more) & set(got[2:]) and SCRATCH_PAGE not in more
    with pytest.raises(RuntimeError, match="not allocated"):
        a.free([more[0], more[0]])
    with pytest.raises(RuntimeError, match="not allocated"):
        a.free([SCRATCH_PAGE])
    assert a.pages_for(0) == 0 and a.pages_for(4) == 1 and a.pages_for(5) == 2
    with pytest.raises(ValueError):
        PageAllocator(1, 64)


def test_block_table_and_slots():
    bt = block_table([[3, 5], [7]], rows=4, width=3)
    np.testing.assert_array_equal(bt, [[3, 5, 0], [7, 0, 0], [0, 0, 0], [0, 0, 0]])
    assert bt.dtype == np.int32
    np.testing.assert_array_equal(slots([3, 5], np.array([0, 3, 4, 6]), 4), [12, 15, 20, 22])
    with pytest.raises(ValueError, match="wide"):
        block_table([[1, 2, 3, 4]], rows=1, width=3)


# ---------------------------------------------------------------- scheduler (simulated model)
def _simulate(prompts, params, *, num_pages, page_size, max_num_seqs, budget, max_model_len, eos=frozenset()):
    """Run the scheduler with a fake model whose next token is (sum of all tokens so far) % 97.
    Checks page ownership invariants every step; returns requests and the scheduler."""
    alloc = PageAllocator(num_pages, page_size)
    sched = Scheduler(alloc, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len)
    reqs = [Request(i, list(p), params, seed=i) for i, p in enumerate(prompts)]
    for r in reqs:
        sched.add(r)
    cache = {}  # slot -> token written there (the fake KV cache)
    steps = collections.Counter()
    while sched.has_unfinished():
        out = sched.schedule()
        assert out is not None
        steps[out.kind] += 1
        owned = [p for r in sched.running for p in r.pages]
        assert len(owned) == len(set(owned)) and SCRATCH_PAGE not in owned
        assert len(owned) + alloc.num_free == alloc.num_usable
        assert len(sched.running) <= max_num_seqs
        new = []
        if out.kind == "prefill":
            assert sum(c.length for c in out.prefill) <= budget
            for c in out.prefill:
                r = c.request
                assert c.start == r.num_computed and c.length >= 1
                ids = r.all_token_ids
                for pos in range(c.start, c.start + c.length):
                    cache[r.pages[pos // page_size] * page_size + pos % page_size] = ids[pos]
                r.num_computed += c.length
                if c.samples:
                    new.append(r)
        else:
            for r in out.decode:
                pos = r.num_tokens - 1
                cache[r.pages[pos // page_size] * page_size + pos % page_size] = r.all_token_ids[pos]
                r.num_computed = r.num_tokens
                new.append(r)
        for r in new:
            # the fake model reads the whole context back from the cache: a corrupted page changes the result
            ctx = [cache[r.pages[p // page_size] * page_size + p % page_size] for p in range(r.num_computed)]
            assert ctx == r.all_token_ids[: r.num_computed]
            r.output_token_ids.append(sum(ctx) % 97)
            reason = sched.check_stop(r, eos)
            if reason:
                sched.finish(r, reason)
    assert alloc.num_free == alloc.num_usable
    return reqs, sched, steps


def _expected(prompt, n):
    ids = list(prompt)
    for _ in range(n):
        ids.append(sum(ids) % 97)
    return ids[len(prompt):]


def test_scheduler_chunked_prefill_and_preemption_keep_results():
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(0, 50, size=n)) for n in (5, 17, 1, 9, 30, 12)]
    params = SamplingParams(max_tokens=20)
    reqs, sched, steps = _simulate(prompts, params, num_pages=14, page_size=4, max_num_seqs=4, budget=7,
                                   max_model_len=52)
    for r, p in zip(reqs, prompts):
        assert r.status is Status.FINISHED and r.finish_reason == "length"
        assert r.output_token_ids == _expected(p, 20)
    assert sched.num_preemptions > 0 and steps["prefill"] > len(prompts)  # chunking + preemption happened


def test_scheduler_stop_and_max_model_len():
    prompts = [[1, 2, 3], [4, 5]]
    eos = frozenset({_expected([1, 2, 3], 3)[-1]})
    reqs, _, _ = _simulate(prompts, SamplingParams(max_tokens=50), num_pages=8, page_size=4, max_num_seqs=2,
                           budget=16, max_model_len=10, eos=eos)
    assert reqs[0].finish_reason == "stop" and len(reqs[0].output_token_ids) <= 3
    assert reqs[1].finish_reason in ("length", "stop") and reqs[1].num_tokens <= 10
    reqs, _, _ = _simulate([[4, 5]], SamplingParams(max_tokens=50), num_pages=8, page_size=4, max_num_seqs=2,
                           budget=16, max_model_len=10)
    assert reqs[0].finish_reason == "length" and reqs[0].num_tokens == 10


def test_scheduler_rejects_cache_smaller_than_one_sequence():
    with pytest.raises(ValueError, match="max_model_len"):
        Scheduler(PageAllocator(4, 4), max_num_seqs=2, max_num_batched_tokens=8, max_model_len=13)


# ---------------------------------------------------------------- sampling
def _sample(logits, temperature, top_k, top_p, seeds, steps):
    f = jax.jit(sample)
    return f(jnp.asarray(logits, jnp.float32), jnp.asarray(temperature, jnp.float32),
             jnp.asarray(top_k, jnp.int32), jnp.asarray(top_p, jnp.float32),
             jnp.asarray(seeds, jnp.uint32), jnp.asarray(steps, jnp.int32))


def test_greedy_and_logprobs():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(5, 33)).astype(np.float32) * 3
    tok, lp = _sample(logits, [0] * 5, [-1] * 5, [1.0] * 5, [0] * 5, [0] * 5)
    np.testing.assert_array_equal(tok, logits.argmax(-1))
    ref = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(
        -1, keepdims=True)
    np.testing.assert_allclose(lp, ref[np.arange(5), logits.argmax(-1)], rtol=1e-5, atol=1e-6)


def test_seeded_sampling_independent_of_batch_composition():
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(4, 50)).astype(np.float32)
    row = logits[1]
    alone = _sample(row[None], [0.8], [-1], [1.0], [1234], [7])
    # same row in a batch whose neighbours are greedy, top-k and top-p filtered (forcing the filtering branch)
    mixed = _sample(logits, [0.0, 0.8, 1.0, 0.5], [-1, -1, 3, -1], [1.0, 1.0, 1.0, 0.3], [1, 1234, 3, 4],
                    [0, 7, 2, 9])
    assert int(alone[0][0]) == int(mixed[0][1])
    np.testing.assert_allclose(float(alone[1][0]), float(mixed[1][1]), rtol=1e-6)
    # a different step or seed gives a fresh draw somewhere over a few steps
    draws = {int(_sample(row[None], [0.8], [-1], [1.0], [1234], [s])[0][0]) for s in range(20)}
    assert len(draws) > 1


def test_sampling_distribution_and_filters():
    logits = np.log(np.array([0.4, 0.3, 0.15, 0.1, 0.05], np.float32))
    n = 4000
    L = np.tile(logits, (n, 1))
    seeds = np.full(n, 99)
    steps = np.arange(n)
    tok, lp = _sample(L, np.ones(n), -np.ones(n), np.ones(n), seeds, steps)
    freq = np.bincount(np.asarray(tok), minlength=5) / n
    np.testing.assert_allclose(freq, [0.4, 0.3, 0.15, 0.1, 0.05], atol=0.03)
    np.testing.assert_allclose(lp, logits[np.asarray(tok)], rtol=1e-5)  # logprob of the unfiltered distribution
    # top-k = 2 renormalises over {0, 1}
    tok, _ = _sample(L, np.ones(n), np.full(n, 2), np.ones(n), seeds, steps)
    freq = np.bincount(np.asarray(tok), minlength=5) / n
    np.testing.assert_allclose(freq, [0.4 / 0.7, 0.3 / 0.7, 0, 0, 0], atol=0.03)
    # top-p = 0.8: nucleus {0, 1, 2} (exclusive cumsum 0, .4, .7 < .8)
    tok, _ = _sample(L, np.ones(n), -np.ones(n), np.full(n, 0.8), seeds, steps)
    freq = np.bincount(np.asarray(tok), minlength=5) / n
    np.testing.assert_allclose(freq, np.array([0.4, 0.3, 0.15, 0, 0]) / 0.85, atol=0.03)
    # top-k 1 == greedy; low temperature concentrates on the argmax
    tok, _ = _sample(L[:50], np.ones(50), np.ones(50), np.ones(50), seeds[:50], steps[:50])
    assert (np.asarray(tok) == 0).all()
    tok, _ = _sample(L[:200], np.full(200, 0.05), -np.ones(200), np.ones(200), seeds[:200], steps[:200])
    assert (np.asarray(tok) == 0).mean() > 0.99
