"""Page allocator and block-table helpers for the paged MLA KV cache (docs/architecture.md §2).

A page holds `page_size` consecutive tokens of one sequence in every layer's cache (the layers share one page
numbering). Slot of token position p of a sequence = block[p // page_size] * page_size + p % page_size.
Page 0 is never handed out: it is the scratch page that unused block-table entries point at, so reading a
padded entry (e.g. the prefill step's gather of a row's pages, masked afterwards) stays in range and never
depends on a live sequence. Padding rows write nothing (slot -1, which MLAKVCache.write skips).
"""
from __future__ import annotations

import numpy as np

SCRATCH_PAGE = 0


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class PageAllocator:
    """Free list over pages 1..num_pages-1 (page 0 is the scratch page). LIFO reuse keeps hot pages hot."""

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is the scratch page), got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free = list(range(num_pages - 1, 0, -1))  # pop() hands out the lowest page first
        self._is_free = np.ones(num_pages, dtype=bool)
        self._is_free[SCRATCH_PAGE] = False

    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        """Pages a sequence of num_tokens tokens occupies."""
        return cdiv(num_tokens, self.page_size)

    def can_allocate(self, n: int, near=None) -> bool:
        """near: pages the sequence already holds (one pool here; mla_jax.sharding.DevicePagePools uses it)."""
        return n <= len(self._free)

    def shares_pool(self, a: list[int], b: list[int]) -> bool:
        """Whether freeing pages a can make room for pages near b (always, with one pool)."""
        return True

    def allocate(self, n: int, near=None) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            raise RuntimeError(f"out of KV-cache pages: asked for {n}, {len(self._free)} free "
                               "(the scheduler must check can_allocate first)")
        pages = [self._free.pop() for _ in range(n)]
        self._is_free[pages] = False
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if p == SCRATCH_PAGE or not (0 < p < self.num_pages) or self._is_free[p]:
                raise RuntimeError(f"freeing page {p} that is not allocated (double free or foreign page)")
            self._is_free[p] = True
            self._free.append(p)


def block_table(page_lists: list[list[int]], rows: int, width: int) -> np.ndarray:
    """int32 [rows, width]: row i = page_lists[i] padded with the scratch page; rows past the lists are all
    scratch."""
    bt = np.full((rows, width), SCRATCH_PAGE, dtype=np.int32)
    for i, pages in enumerate(page_lists):
        if len(pages) > width:
            raise ValueError(f"sequence {i} holds {len(pages)} pages, block table is {width} wide")
        bt[i, : len(pages)] = pages
    return bt


def slots(pages: list[int], positions: np.ndarray, page_size: int) -> np.ndarray:
    """Cache slots (int32) of the given token positions of a sequence whose pages are `pages`."""
    positions = np.asarray(positions, dtype=np.int64)
    pages_arr = np.asarray(pages, dtype=np.int64)
    return (pages_arr[positions // page_size] * page_size + positions % page_size).astype(np.int32)
