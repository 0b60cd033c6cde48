"""Soak: 1,000 requests in waves through LLM.generate on the embedded model (CPU), loaded by name from another
working directory. After warm-up (one wave per batch bucket, which compiles every step variant these waves use)
the engine compiles nothing more, live device buffers stay exactly constant, RSS stays flat, every request is
accounted for (one output each, in order, a valid finish reason and token count), no Request object or KV-cache
page outlives its wave, and a wave repeated at the end reproduces its first run token for token."""
from __future__ import annotations

import gc
import os
import time

import jax
import numpy as np
import pytest

import mla_jax
from mla_jax.engine.scheduler import Request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.skipif(not os.path.isdir(os.path.join(REPO, "checkpoints", "tiny-deepseek-py")),
                                reason="embedded model not in this checkout")

MAX_NUM_SEQS = 8
MAX_MODEL_LEN = 32            # prompts of <= 16 tokens + <= 4 new: one page, one prefill chunk bucket
WAVES, WAVE_SIZE = 10, 100
RSS_SLACK_MB = 24             # allocator noise; a leak of >= 35 KB a request over 700 requests exceeds it
RSS_STEP_MB = 96              # one wave's jump, however it comes (the allocator took a new arena: 19 MB once)


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _wave(rng, n, warm=False):
    prompts = [[int(t) for t in rng.integers(3, 4096, size=int(rng.integers(1, 17)))] for _ in range(n)]
    params = [mla_jax.SamplingParams(temperature=float(rng.choice([0.0, 0.8])), top_k=int(rng.choice([-1, 20])),
                                     max_tokens=2 if warm else int(rng.integers(0, 5)),
                                     ignore_eos=warm or bool(rng.integers(0, 2)), seed=int(rng.integers(0, 2**31)))
              for _ in range(n)]
    return prompts, params


def _check_accounted(llm, prompts, params, outs):
    assert len(outs) == len(prompts)
    for i, (o, p, sp) in enumerate(zip(outs, prompts, params)):
        assert o.request_id == i and o.error is None and o.prompt_token_ids == p
        assert o.finish_reason in ("length", "stop"), o
        assert len(o.token_ids) <= sp.max_tokens
        if o.finish_reason == "length":
            assert len(o.token_ids) == sp.max_tokens
        else:
            assert not sp.ignore_eos and o.token_ids[-1] in llm.eos_token_ids
    assert not llm.scheduler.has_unfinished()
    assert llm.allocator.num_free == llm.allocator.num_usable          # no page outlives its request


@pytest.mark.slow
def test_soak_1000_requests_in_waves(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)                     # the embedded model by name, from another working directory
    gc.collect()
    alive_before = [o for o in gc.get_objects() if isinstance(o, Request)]   # held alive: their ids stay unique
    before = {id(o) for o in alive_before}
    llm = mla_jax.LLM("tiny-deepseek-py", max_num_seqs=MAX_NUM_SEQS, max_model_len=MAX_MODEL_LEN, seed=0)
    seed = int(time.time())
    rng = np.random.default_rng(seed)
    b = 1
    while b <= MAX_NUM_SEQS:                        # warm-up: prefill and decode at every batch bucket
        llm.generate(*_wave(rng, b, warm=True))
        b *= 2
    compiles = llm.num_compiles()
    first = _wave(rng, WAVE_SIZE)
    first_outs = None
    rss, live = [], []
    for w in range(WAVES):                          # the last wave repeats the first
        prompts, params = first if w in (0, WAVES - 1) else _wave(rng, WAVE_SIZE)
        outs = llm.generate(prompts, params)
        _check_accounted(llm, prompts, params, outs)
        if w == 0:
            first_outs = outs
        elif w == WAVES - 1:                        # same requests, same seeds: the same tokens (no state leaks)
            for a, b in zip(first_outs, outs):
                assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason, (seed, a, b)
        del outs
        gc.collect()
        # (Requests that other tests' objects still hold were alive before this test began: they do not count)
        assert not [o for o in gc.get_objects() if isinstance(o, Request) and id(o) not in before], \
            "a Request outlived its wave"
        rss.append(_rss_mb())
        live.append(len(jax.live_arrays()))
    assert llm.num_compiles() == compiles, "steady state compiled a new step variant"
    assert len(set(live)) == 1, f"live device buffers changed between waves: {live}"
    settled = rss[2:]                               # the first waves settle the allocator's arenas
    print(f"\nsoak (seed {seed}): RSS per wave (MB) {[round(r) for r in rss]}; live buffers {live[0]}")
    # a leak grows RSS every wave; the allocator grows it in rare steps (a CI run saw +18.8 MB in the last wave
    # alone, every other wave flat). So the typical (median) wave's growth, times the waves, is held to the slack,
    # and any single step to a looser bound.
    steps = np.diff(settled)
    assert np.median(steps) * len(steps) <= RSS_SLACK_MB, f"RSS grew wave after wave (seed {seed}): {rss}"
    assert max(settled) - settled[0] <= RSS_STEP_MB, f"RSS jumped over the waves (seed {seed}): {rss}"
