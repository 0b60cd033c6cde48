"""Page pools for data-parallel attention: host-side bookkeeping for the engine's scheduler. With data-parallel
attention the KV cache's pages are split evenly over the devices (docs/architecture.md §7), so every sequence
takes all its pages from one device's pool and sits in that device's block of decode rows."""
from __future__ import annotations

from typing import Optional, Sequence

from .paged import PageAllocator


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

    def num_free_on(self, device: int) -> int:
        """Free pages in device's pool (what the sequences on that device can still grow into)."""
        return self._pools[device].num_free

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
