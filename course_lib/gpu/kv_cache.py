"""A paged KV cache: the keys and values of several sequences in fixed-size pages of one big table per layer.

Modelled on nano-vllm's block manager. Each layer has a key table and a value table on the device,
[pages * page_size, Hkv, hd]; page p holds the rows p * page_size .. (p + 1) * page_size - 1. A sequence owns a
list of pages (its page table), taken from a free list one at a time as it grows, so its logical position j lives
at row page_table[j // page_size] * page_size + j % page_size and sequences never need contiguous memory. Freeing
a sequence gives its pages back. The bookkeeping is host-side Python; the kernels only see the tables, the page
table of a sequence (int32, padded with -1) and the slot (row) of each new token (`kernels.paged_attention`).

Errors (each leaves the cache as it was: no page taken, no length changed):
- `CacheFullError` (RuntimeError): not enough free pages for the new tokens;
- `SequenceTooLongError` (ValueError): the sequence would pass its max_len;
- `UnknownSequenceError` (ValueError): the id is not in the cache (never added, or freed);
- `SequenceExistsError` (ValueError): `add` with an id that is already in the cache.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable

import numpy as np

from ..kernels import empty
from ..model.config import ModelConfig

PAGE_SIZE = 16  # positions per page of the course's caches (the backend's, the batch's)


class CacheFullError(RuntimeError):
    """No free page left for the tokens asked for (nothing was reserved)."""


class SequenceTooLongError(ValueError):
    """The tokens asked for would take a sequence past its max_len (nothing was reserved)."""


class UnknownSequenceError(ValueError):
    """No sequence of that id in the cache (never added, or already freed)."""


class SequenceExistsError(ValueError):
    """`add` of an id that is already in the cache."""


class PagedKVCache:
    """Keys and values of several sequences, in pages of page_size positions.

    k[layer], v[layer]: device arrays [pages * page_size, n_kv_heads, head_dim], float32 for dtype "f32" or uint16
    holding bf16 bits for dtype "bf16" (allocated once; `rt`, a course_lib.gpu.runtime.Runtime, allocates them when
    given), or NumPy arrays of zeros with host=True (the NumPy reference's batched generator, course_lib.batch).
    max_len: the default longest sequence (pages * page_size when None).
    """

    def __init__(self, config: ModelConfig, pages: int, page_size: int = 16, dtype: str = "f32",
                 max_len: int | None = None, rt=None, host: bool = False):
        if dtype not in ("f32", "bf16"):
            raise ValueError(f"dtype must be 'f32' or 'bf16', got {dtype!r}")
        if pages < 1 or page_size < 1:
            raise ValueError(f"need pages >= 1 and page_size >= 1, got {pages} and {page_size}")
        self.config, self.pages, self.page_size, self.dtype = config, pages, page_size, dtype
        self.max_len = pages * page_size if max_len is None else max_len
        shape = (pages * page_size, config.n_kv_heads, config.head_dim)
        np_dtype = np.float32 if dtype == "f32" else np.uint16
        table = (lambda: np.zeros(shape, np_dtype)) if host else (lambda: empty(shape, np_dtype, rt=rt))
        self.k = [table() for _ in range(config.n_layers)]
        self.v = [table() for _ in range(config.n_layers)]
        self._free = list(range(pages))  # a heap: the lowest free page is taken first
        self._pages: dict[Hashable, list[int]] = {}  # sequence -> its pages, in logical order
        self._length: dict[Hashable, int] = {}  # sequence -> positions reserved
        self._max_len: dict[Hashable, int] = {}

    # ---- sequences ----

    def add(self, seq_id: Hashable, max_len: int | None = None) -> None:
        """Start an empty sequence (no page taken yet) that may grow to max_len positions (default: the cache's)."""
        if seq_id in self._pages:
            raise SequenceExistsError(f"sequence {seq_id!r} is already in the cache")
        max_len = self.max_len if max_len is None else max_len
        if max_len < 1:
            raise ValueError(f"max_len must be >= 1, got {max_len}")
        self._pages[seq_id], self._length[seq_id], self._max_len[seq_id] = [], 0, max_len

    def slots(self, seq_id: Hashable, n_new: int) -> np.ndarray:
        """Reserve the next n_new positions of the sequence (length .. length + n_new - 1), taking pages from the
        free list as needed, and advance its length. -> int32 [n_new]: the table row (slot) of each position,
        page * page_size + offset. Raises (changing nothing) when the sequence would pass its max_len or when
        the free pages do not suffice."""
        pages, start = self._pages_of(seq_id), self._length[seq_id]
        if n_new < 0:
            raise ValueError(f"n_new must be >= 0, got {n_new}")
        end = start + n_new
        if end > self._max_len[seq_id]:
            raise SequenceTooLongError(f"sequence {seq_id!r}: {start} + {n_new} positions pass its max_len "
                                       f"{self._max_len[seq_id]}")
        missing = -(-end // self.page_size) - len(pages)
        if missing > len(self._free):
            raise CacheFullError(f"sequence {seq_id!r} needs {missing} more pages, {len(self._free)} are free")
        pages += [heapq.heappop(self._free) for _ in range(missing)]
        self._length[seq_id] = end
        size = self.page_size  # Python integers: a decode step reserves one position each for up to 64 sequences
        return np.fromiter((pages[j // size] * size + j % size for j in range(start, end)), np.int32, n_new)

    def free(self, seq_id: Hashable) -> None:
        """Forget the sequence and give its pages back to the free list."""
        for p in self._pages_of(seq_id):
            heapq.heappush(self._free, p)
        del self._pages[seq_id], self._length[seq_id], self._max_len[seq_id]

    # ---- queries ----

    def length(self, seq_id: Hashable) -> int:
        """Positions reserved so far for the sequence."""
        self._pages_of(seq_id)
        return self._length[seq_id]

    def page_table(self, seq_id: Hashable, width: int) -> np.ndarray:
        """int32 [width]: the sequence's pages in logical order, padded with -1 (raises if it holds more)."""
        pages = self.pages_of(seq_id)
        if len(pages) > width:
            raise ValueError(f"sequence {seq_id!r} holds {len(pages)} pages, more than width {width}")
        table = np.full(width, -1, np.int32)
        table[:len(pages)] = pages
        return table

    def pages_of(self, seq_id: Hashable) -> list[int]:
        """The sequence's pages in logical order (the cache's own list: read it, do not change it)."""
        return self._pages_of(seq_id)

    @property
    def free_pages(self) -> int:
        """Pages on the free list."""
        return len(self._free)

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._pages

    def _pages_of(self, seq_id: Hashable) -> list[int]:
        try:
            return self._pages[seq_id]
        except (KeyError, TypeError):
            raise UnknownSequenceError(f"no sequence {seq_id!r} in the cache (never added, or freed)") from None
