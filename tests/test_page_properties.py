"""Property tests of the KV-cache page bookkeeping (hypothesis): random admit / grow / preempt / free sequences on
the allocators, and random workloads through the scheduler with a small page pool (so it preempts).

Invariants, checked after every operation against an independent record of which sequence owns which page: no
page is owned twice, none is leaked (owned + free = usable), the scratch page(s) are never handed out, the free
count is right, and with data-parallel attention every sequence's pages come from one device's pool."""
from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mla_jax.engine.paged import SCRATCH_PAGE, PageAllocator
from mla_jax.engine.params import SamplingParams
from mla_jax.engine.pools import DevicePagePools
from test_engine_units import _expected, _simulate


class AllocatorMachine(RuleBasedStateMachine):
    """Sequences take pages when admitted, take more as they grow, and give all back when preempted or
    finished. `owner` (page -> sequence) is the reference the allocator is checked against."""

    def __init__(self):
        super().__init__()
        self.alloc = None
        self.seqs: dict[int, list[int]] = {}
        self.owner: dict[int, int] = {}
        self.next_id = 0

    @rule(num_pages=st.integers(2, 40), page_size=st.sampled_from([1, 4, 64]), devices=st.sampled_from([1, 2, 4]),
          seqs_per_device=st.integers(1, 4))
    @precondition(lambda self: self.alloc is None)
    def create(self, num_pages, page_size, devices, seqs_per_device):
        if devices == 1:
            self.alloc = PageAllocator(num_pages, page_size)
            self.scratch = {SCRATCH_PAGE}
            self.usable = num_pages - 1
        else:
            per_device = max(2, num_pages // devices)
            self.alloc = DevicePagePools(per_device * devices, page_size, devices, seqs_per_device)
            self.scratch = {d * per_device for d in range(devices)}     # each pool's local page 0
            self.usable = (per_device - 1) * devices

    def _take(self, seq: int, pages: list[int]) -> None:
        for p in pages:
            assert p not in self.owner, f"page {p} handed out while sequence {self.owner.get(p)} owns it"
            assert p not in self.scratch and 0 <= p < self.alloc.num_pages
            self.owner[p] = seq
        self.seqs[seq] += pages

    @rule(n=st.integers(1, 12))         # a sequence holds >= 1 token, so >= 1 page
    @precondition(lambda self: self.alloc is not None)
    def admit(self, n):
        if not self.alloc.can_allocate(n):
            with pytest.raises(RuntimeError):
                self.alloc.allocate(n)
            return
        seq, self.next_id = self.next_id, self.next_id + 1
        self.seqs[seq] = []
        self._take(seq, self.alloc.allocate(n))

    @rule(data=st.data(), n=st.integers(1, 6))
    @precondition(lambda self: any(self.seqs.values()))
    def grow(self, data, n):
        seq = data.draw(st.sampled_from(sorted(s for s, p in self.seqs.items() if p)))
        near = list(self.seqs[seq])
        if self.alloc.can_allocate(n, near=near):
            self._take(seq, self.alloc.allocate(n, near=near))

    @rule(data=st.data())
    @precondition(lambda self: bool(self.seqs))
    def preempt_or_finish(self, data):
        seq = data.draw(st.sampled_from(sorted(self.seqs)))
        pages = self.seqs.pop(seq)
        self.alloc.free(pages)
        for p in pages:
            del self.owner[p]

    @rule(data=st.data())
    @precondition(lambda self: bool(self.owner))
    def double_free_is_refused(self, data):
        page = data.draw(st.sampled_from(sorted(self.owner)))
        seq = self.owner[page]
        self.alloc.free(self.seqs.pop(seq))
        for p in [p for p, s in self.owner.items() if s == seq]:
            del self.owner[p]
        with pytest.raises(RuntimeError):
            self.alloc.free([page])

    @invariant()
    def pages_accounted(self):
        if self.alloc is None:
            return
        assert self.alloc.num_free == self.usable - len(self.owner)
        owned = [p for pages in self.seqs.values() for p in pages]
        assert len(owned) == len(set(owned)) == len(self.owner)
        if isinstance(self.alloc, DevicePagePools):
            for pages in self.seqs.values():
                if pages:
                    self.alloc.device_of(pages)              # raises unless one device's pool holds them all
            assert sum(self.alloc.seqs_on(d) for d in range(self.alloc.num_devices)) == len(self.seqs)


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), page_size=st.sampled_from([1, 2, 4]), max_num_seqs=st.integers(1, 5),
       budget=st.integers(1, 24), extra_pages=st.integers(0, 12), n=st.integers(1, 8))
def test_scheduler_random_workloads_keep_pages_and_results(seed, page_size, max_num_seqs, budget, extra_pages, n):
    """Random prompts and lengths through the scheduler with a fake model that reads its context back from a fake
    cache (_simulate checks ownership every step and that all pages are free at the end); with few pages it
    chunks and preempts, and every request still gets exactly the tokens of an uninterrupted run."""
    rng = np.random.default_rng(seed)
    max_model_len = 24
    prompts = [list(rng.integers(0, 50, size=int(rng.integers(1, 13)))) for _ in range(n)]
    num_pages = -(-max_model_len // page_size) + 1 + extra_pages     # at least one full-length sequence
    max_tokens = int(rng.integers(1, 12))
    reqs, sched, _ = _simulate(prompts, SamplingParams(max_tokens=max_tokens), num_pages=num_pages,
                               page_size=page_size, max_num_seqs=max_num_seqs, budget=budget,
                               max_model_len=max_model_len)
    for r, p in zip(reqs, prompts):
        want = _expected(p, min(max_tokens, max_model_len - len(p)))
        assert r.finish_reason == "length" and r.output_token_ids == want
        assert r.pages == []
    assert not sched.has_unfinished()
