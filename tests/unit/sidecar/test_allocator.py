"""ExtentAllocator: no overlap, no overrun, coalescing, bounded fragmentation."""

from __future__ import annotations

import itertools
import random

import pytest

from kvstrata.sidecar.allocator import ExtentAllocator


def check_invariants(alloc: ExtentAllocator) -> None:
    live = alloc.live_extents()
    free = alloc.free_extents()
    everything = sorted(live + free)
    cursor = 0
    for start, length in everything:  # live and free tile [0, size) exactly
        assert start == cursor, f"gap or overlap at {start} (expected {cursor})"
        assert start % alloc.alignment == 0 and length % alloc.alignment == 0
        cursor = start + length
    assert cursor == alloc.size
    for (s1, l1), (s2, _) in itertools.pairwise(free):
        assert s1 + l1 != s2, "two free neighbours were not merged"
    assert alloc.used_bytes == sum(length for _, length in live)


def test_alloc_and_free_round_trip_leaves_one_free_extent():
    alloc = ExtentAllocator(1 << 20)
    offsets = [alloc.alloc(1000) for _ in range(10)]
    assert all(o is not None and o % 256 == 0 for o in offsets)
    assert len(set(offsets)) == 10
    for o in offsets[::2] + offsets[1::2]:
        alloc.free(o)
    assert alloc.free_extents() == [(0, 1 << 20)]
    check_invariants(alloc)


def test_alloc_returns_none_when_no_extent_fits():
    alloc = ExtentAllocator(4096)
    assert alloc.alloc(4096) == 0
    assert alloc.alloc(1) is None
    alloc.free(0)
    assert alloc.alloc(4097) is None


def test_best_fit_picks_the_smallest_extent_that_fits():
    alloc = ExtentAllocator(64 * 256)
    a, b, c, d = (alloc.alloc(n * 256) for n in (4, 1, 2, 1))
    alloc.free(a)  # 4-unit hole at 0
    alloc.free(c)  # 2-unit hole
    assert alloc.alloc(2 * 256) == c
    assert alloc.alloc(3 * 256) == a
    del b, d


def test_freeing_an_unknown_offset_is_refused():
    alloc = ExtentAllocator(4096)
    with pytest.raises(ValueError, match="not an allocated extent"):
        alloc.free(256)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_churn_never_overlaps_or_overruns_and_fragmentation_stays_bounded(seed):
    """Mixed sizes (1..64 KiB) held near 90% occupancy, 3000 steps per seed.

    Every refusal really had no fitting extent. Measured (20000 steps,
    seeds 1-3): fragmentation (1 - largest free / free) averages 0.78 -- the
    last ~10% of the arena is in pieces -- yet only ~4% of requests are
    refused while 83-90% of the arena is live: no death spiral."""
    rng = random.Random(seed)
    alloc = ExtentAllocator(1 << 22)
    live: dict[int, int] = {}
    frag = []
    refused = tries = 0
    for _ in range(3000):
        if live and (alloc.used_bytes > 0.9 * alloc.size or rng.random() < 0.45):
            offset = rng.choice(list(live))
            alloc.free(offset)
            del live[offset]
        else:
            n = rng.randint(1, 64) * 1024 - rng.randint(0, 255)
            offset = alloc.alloc(n)
            tries += 1
            if offset is None:
                refused += 1
                assert alloc.largest_free < alloc.allocation_size(n)
            else:
                assert offset + n <= alloc.size
                live[offset] = n
        check_invariants(alloc)
        frag.append(alloc.fragmentation())
    assert sum(frag) / len(frag) < 0.9
    assert refused / tries < 0.1
    assert alloc.used_bytes > 0.75 * alloc.size
