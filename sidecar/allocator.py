"""Best-fit extent allocator for the L1 arena.

Why best-fit with coalescing: chunk objects have variable sizes (models,
partial layouts, tiny test shapes share one arena). Best-fit keeps large
extents whole for large objects, and merging a freed extent with its free
neighbours at once means the free space never shatters into pieces that
no object fits (the death spiral of a plain free list). The churn test in
``tests/unit/sidecar/test_allocator.py`` measures what remains.

State (in process memory only; nothing is persisted):

* ``_free_by_start``: start offset -> length of each free extent;
* ``_free_by_end``: end offset -> start offset (to find the left neighbour);
* ``_by_size``: sorted list of ``(length, start)`` (the best-fit index);
* ``_live``: start offset -> length of each allocated extent.

Every extent starts and ends on a multiple of ``alignment`` (256 bytes by
default: cache-line and DMA friendly). Not thread-safe: the engine calls it
under its index lock.
"""

from __future__ import annotations

import bisect

DEFAULT_ALIGNMENT = 256


def align_up(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


class ExtentAllocator:
    """Allocates ``[offset, offset + length)`` extents inside ``[0, size)``."""

    def __init__(self, size: int, alignment: int = DEFAULT_ALIGNMENT) -> None:
        if alignment < 1 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        self.alignment = alignment
        self.size = size - size % alignment
        self._free_by_start: dict[int, int] = {}
        self._free_by_end: dict[int, int] = {}
        self._by_size: list[tuple[int, int]] = []
        self._live: dict[int, int] = {}
        self.used_bytes = 0
        if self.size > 0:
            self._add_free(0, self.size)

    # -- queries --------------------------------------------------------------

    @property
    def free_bytes(self) -> int:
        return self.size - self.used_bytes

    @property
    def largest_free(self) -> int:
        return self._by_size[-1][0] if self._by_size else 0

    @property
    def live_count(self) -> int:
        return len(self._live)

    def fragmentation(self) -> float:
        """``1 - largest_free / free_bytes``: 0 when all free space is one extent."""
        free = self.free_bytes
        return 0.0 if free == 0 else 1.0 - self.largest_free / free

    def allocation_size(self, nbytes: int) -> int:
        """Bytes an object of ``nbytes`` occupies (aligned, at least one unit)."""
        return align_up(max(nbytes, 1), self.alignment)

    def live_extents(self) -> list[tuple[int, int]]:
        """``(start, length)`` of every allocated extent, sorted (for tests)."""
        return sorted(self._live.items())

    def free_extents(self) -> list[tuple[int, int]]:
        return sorted(self._free_by_start.items())

    # -- alloc / free ---------------------------------------------------------

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a fresh extent of at least ``nbytes``; None if no free extent fits."""
        need = self.allocation_size(nbytes)
        i = bisect.bisect_left(self._by_size, (need, -1))
        if i == len(self._by_size):
            return None
        length, start = self._by_size[i]
        self._remove_free(start, length, index=i)
        if length > need:
            self._add_free(start + need, length - need)
        self._live[start] = need
        self.used_bytes += need
        return start

    def free(self, offset: int) -> int:
        """Return an extent; merges it with free neighbours. Returns its length."""
        length = self._live.pop(offset, None)
        if length is None:
            raise ValueError(f"offset {offset} is not an allocated extent")
        self.used_bytes -= length
        start, end = offset, offset + length
        left = self._free_by_end.get(start)
        if left is not None:
            self._remove_free(left, start - left)
            start = left
        right_len = self._free_by_start.get(end)
        if right_len is not None:
            self._remove_free(end, right_len)
            end += right_len
        self._add_free(start, end - start)
        return length

    def reset(self) -> None:
        """Free everything at once."""
        self.__init__(self.size, self.alignment)  # type: ignore[misc]

    # -- internals ------------------------------------------------------------

    def _add_free(self, start: int, length: int) -> None:
        self._free_by_start[start] = length
        self._free_by_end[start + length] = start
        bisect.insort(self._by_size, (length, start))

    def _remove_free(self, start: int, length: int, index: int | None = None) -> None:
        del self._free_by_start[start]
        del self._free_by_end[start + length]
        if index is None:
            index = bisect.bisect_left(self._by_size, (length, start))
        del self._by_size[index]
