"""The disk tier's index, alone: no files, no threads, no tier.

:class:`DiskIndex` decides which files the disk tier keeps and which it
evicts; these tests drive it call by call, as the tier does under its lock.
"""

from __future__ import annotations

import time

from kvstrata.sidecar.objformat import ChunkMeta
from kvstrata.sidecar.tiers.disk_index import DiskEntry, DiskIndex
from kvstrata.sidecar.tiers.tenant_shares import TenantShares

NS_A, NS_B = b"a" * 16, b"b" * 16


def _key(namespace: bytes, n: int) -> bytes:
    return namespace + n.to_bytes(32, "big")


def _entry(nbytes: int, tenant: str = "", young: bool = False) -> DiskEntry:
    stored_at = time.monotonic() if young else float("-inf")
    return DiskEntry(nbytes, 0, nbytes, ChunkMeta(tenant=tenant), stored_at=stored_at)


def _index(
    capacity: int, quota: int | None = None, shares: TenantShares | None = None
) -> DiskIndex:
    return DiskIndex(capacity, quota, shares or TenantShares(), young_seconds=3600.0)


def test_a_write_evicts_the_least_recently_used_files_first() -> None:
    index = _index(300)
    for n in range(3):
        index.add(_key(NS_A, n), _entry(100))
    index.touch(_key(NS_A, 0))  # now the most recent
    fits, evicted = index.admit(_key(NS_A, 9), "", 150)
    assert fits and evicted == [_key(NS_A, 1), _key(NS_A, 2)]
    assert (index.usage, index.reserved, len(index)) == (100, 150, 1)
    index.release("", 150)
    assert index.reserved == 0
    assert index.evictions_total == 2


def test_a_file_larger_than_the_tier_is_refused_evicting_nothing() -> None:
    index = _index(300)
    index.add(_key(NS_A, 0), _entry(100))
    assert index.admit(_key(NS_A, 1), "", 301) == (False, [])
    assert len(index) == 1


def test_a_namespace_over_its_quota_evicts_its_own_files_only() -> None:
    index = _index(1000, quota=200)
    index.add(_key(NS_B, 0), _entry(100))  # the least recent, but another namespace's
    index.add(_key(NS_A, 0), _entry(100))
    index.add(_key(NS_A, 1), _entry(100))
    fits, evicted = index.admit(_key(NS_A, 2), "", 100)
    assert fits and evicted == [_key(NS_A, 0)]
    assert _key(NS_B, 0) in index


def test_a_pinned_tenants_files_are_passed_over_and_the_write_may_then_not_fit() -> None:
    shares = TenantShares(budgets={"gold": 200}, pinned=["gold"])
    index = _index(300, shares=shares)
    index.add(_key(NS_A, 0), _entry(100, tenant="gold"))
    index.add(_key(NS_A, 1), _entry(100, tenant="gold"))
    index.add(_key(NS_A, 2), _entry(100))
    fits, evicted = index.admit(_key(NS_A, 3), "", 200)
    assert not fits and evicted == [_key(NS_A, 2)]
    assert index.reserved == 0
    assert shares.usage["gold"] == 200


def test_evictions_of_files_written_moments_ago_count_as_young() -> None:
    index = _index(200)
    index.add(_key(NS_A, 0), _entry(100))  # found at start: old
    index.add(_key(NS_A, 1), _entry(100, young=True))
    assert index.evict(200) == [_key(NS_A, 0), _key(NS_A, 1)]
    assert (index.evictions_total, index.young_evictions_total) == (2, 1)


def test_replacing_and_forgetting_keep_the_usage_in_step() -> None:
    index = _index(1000, quota=500)
    assert index.add(_key(NS_A, 0), _entry(100)) is None
    old = index.add(_key(NS_A, 0), _entry(300))
    assert old is not None and old.file_bytes == 100
    assert index.usage == 300
    assert index.pop(_key(NS_A, 0)) is not None and index.pop(_key(NS_A, 0)) is None
    assert (index.usage, index.evictions_total) == (0, 0)  # forgetting is no eviction
    index.add(_key(NS_A, 1), _entry(50))
    assert index.clear() == [_key(NS_A, 1)] and index.usage == 0
