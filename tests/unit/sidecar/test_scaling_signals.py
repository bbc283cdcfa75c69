"""The autoscaling signals: young evictions (thrash), free L1 bytes, queued loads.

The age of an L1 entry is read from the store's clock, so these tests step a
clock of their own instead of waiting: an eviction is young or old by the
steps taken, never by how fast the machine ran.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, generate_latest

from kvstrata.sidecar.engine_metrics import EngineCollector
from kvstrata.sidecar.l1 import L1Store
from kvstrata.sidecar.l1index import L1Index
from kvstrata.sidecar.objformat import ChunkMeta
from kvstrata.sidecar.prefetch import Prefetcher
from kvstrata.sidecar.promotion import Promotion
from kvstrata.sidecar.tiers.disk import DiskTier

from ..conftest import make_key

CHUNK = 64 << 10
META = ChunkMeta("uint8", (CHUNK,))


class SteppedClock:
    """A clock that moves only when the test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _fill(store: L1Store, first: int, n: int) -> None:
    for i in range(first, first + n):
        entry = store.reserve(make_key(i), CHUNK, META)
        assert entry is not None
        store.publish(entry)
        store.unpin(entry)


def test_an_l1_eviction_counts_as_young_only_when_the_entry_was_stored_within_the_window():
    clock = SteppedClock()
    store = L1Store(8 * CHUNK, "fifo", alignment=256, young_seconds=30.0, clock=clock)
    _fill(store, 0, 8)  # full
    clock.now += 31.0  # the first eight are now old
    _fill(store, 8, 4)  # evicts four old entries
    assert (store.evictions_total, store.young_evictions_total) == (4, 0)
    clock.now += 10.0
    _fill(store, 12, 6)  # evicts the last four old ones, then two stored 10 s ago
    assert (store.evictions_total, store.young_evictions_total) == (10, 2)


def test_an_l2_eviction_of_a_file_this_process_wrote_is_young_and_of_one_found_at_start_is_not(
    tmp_path: Any,
):
    tier = DiskTier(tmp_path, 1 << 20, direct=False, young_seconds=1e9)
    for i in range(4):  # 200 KiB files: five fit in 1 MiB
        assert tier.put(make_key(i), b"\x01" * (200 << 10), META)
    tier.close()
    # A restart: the files on disk are re-indexed with no age known, so counted old.
    tier = DiskTier(tmp_path, 1 << 20, direct=False, young_seconds=1e9)
    for i in range(10, 20):
        assert tier.put(make_key(i), b"\x02" * (200 << 10), META)
    stats = tier.stats()
    assert stats.evictions_total == 14 - stats.objects == 9
    # Least recent first: the four found at start, then five written since.
    assert stats.young_evictions_total == 5
    tier.close()


def test_queued_loads_count_the_chunks_a_prefetch_has_not_landed_yet():
    # No tier below L1: every job misses, and lands with nothing leased.
    index = L1Index(L1Store(8 * CHUNK, "fifo"))
    promotion = Promotion(index, memoryview(bytearray(8 * CHUNK)), None, None)
    prefetcher = Prefetcher(index, promotion)

    def may_be_below(key: object) -> bool:
        return True

    try:
        _, first = index.plan_prefetch([make_key(1), make_key(2)], "client/req-1", may_be_below)
        _, second = index.plan_prefetch([make_key(3)], "client/req-2", may_be_below)
        assert index.snapshot().gauges.queued_loads == 3
        prefetcher.start(first, "client/req-1")
        prefetcher.start(second, "client/req-2")
        assert prefetcher.wait(timeout=30.0)
        assert index.snapshot().gauges.queued_loads == 0
    finally:
        prefetcher.close()


def test_metrics_expose_free_l1_bytes_young_evictions_and_queued_loads(make_engine: Any):
    engine = make_engine(l1={"size_bytes": "1Mi"}, l2={"enabled": False})
    for i in range(20):  # 20 x 64 KiB into 1 MiB: four evicted, all within the minute
        assert engine.put(make_key(i), b"\x03" * CHUNK, META)
    registry = CollectorRegistry()
    registry.register(EngineCollector(engine.stats, clients=lambda: 0))
    text = generate_latest(registry).decode()
    samples = {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    stats = engine.stats().tiers["l1"]
    assert samples['kvstrata_young_evictions_total{tier="l1"}'] == stats.evictions_total > 0
    assert samples["kvstrata_l1_free_bytes"] == stats.capacity_bytes - stats.usage_bytes
    assert samples["kvstrata_queued_loads"] == 0
