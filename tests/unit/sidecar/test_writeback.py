"""WriteBehindQueue (tiers/base.py): never blocks, drops and dedupes with counts."""

from __future__ import annotations

import threading

from kvstrata.sidecar.objformat import ChunkMeta
from kvstrata.sidecar.tiers.base import TierStats, WriteBehindQueue, WriteJob
from kvstrata.sidecar.tiers.disk import DiskTier

from ..conftest import make_key

META = ChunkMeta("uint8", (3,))


class GatedDiskTier(DiskTier):
    """FaultInjecting: writes hang until the gate opens (a stalled device)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.started = threading.Semaphore(0)

    def put(self, key, payload, meta):
        self.started.release()
        self.gate.wait(10)
        return super().put(key, payload, meta)


class RaisingDiskTier(DiskTier):
    """FaultInjecting: a tier that breaks its no-raise contract."""

    def put(self, key, payload, meta):
        raise RuntimeError("broken tier")


def test_jobs_are_written_and_on_done_reports_the_outcome(tmp_path):
    tier = DiskTier(tmp_path, 1 << 20)
    queue = WriteBehindQueue(tier, capacity=8, threads=2)
    outcomes: list[bool] = []
    for i in range(5):
        queue.submit(WriteJob(make_key(i), b"abc", META, on_done=outcomes.append))
    assert queue.flush(10)
    assert sorted(outcomes) == [True] * 5
    assert queue.written_total == 5
    assert tier.contains_many([make_key(i) for i in range(5)]) == [True] * 5
    queue.close()


def test_a_full_queue_drops_without_blocking_and_counts(tmp_path):
    tier = GatedDiskTier(tmp_path, 1 << 20)
    queue = WriteBehindQueue(tier, capacity=2, threads=1)
    outcomes: list[bool] = []
    queue.submit(WriteJob(make_key(0), b"abc", META, on_done=outcomes.append))
    assert tier.started.acquire(timeout=10)  # the worker holds job 0
    accepted = [
        queue.submit(WriteJob(make_key(i), b"abc", META, on_done=outcomes.append))
        for i in range(1, 6)
    ]
    assert accepted == [True, True, False, False, False]
    assert queue.dropped_total == 3
    assert outcomes == [False, False, False]  # on_done(False) at once for drops
    tier.gate.set()
    assert queue.flush(10)
    assert outcomes.count(True) == 3
    queue.close()


def test_a_dropped_job_with_on_dropped_gets_that_in_place_of_on_done(tmp_path):
    tier = GatedDiskTier(tmp_path, 1 << 20)
    queue = WriteBehindQueue(tier, capacity=1, threads=1)
    queue.submit(WriteJob(make_key(0), b"abc", META))
    assert tier.started.acquire(timeout=10)  # the worker holds job 0
    assert queue.submit(WriteJob(make_key(1), b"abc", META))  # fills the queue
    calls: list[str] = []
    dropped = WriteJob(
        make_key(2),
        b"abc",
        META,
        on_done=lambda ok: calls.append(f"done {ok}"),
        on_dropped=lambda: calls.append("dropped"),
    )
    assert not queue.submit(dropped)
    assert calls == ["dropped"]
    tier.gate.set()
    assert queue.flush(10)
    assert calls == ["dropped"]
    queue.close()


def test_duplicate_and_already_stored_keys_are_not_written_twice(tmp_path):
    tier = DiskTier(tmp_path, 1 << 20)
    tier.put(make_key(1), b"abc", META)
    queue = WriteBehindQueue(tier, capacity=8, already_stored=tier.contains)
    assert not queue.submit(WriteJob(make_key(1), b"abc", META))
    assert queue.deduplicated_total == 1
    queue.close()


def test_a_raising_tier_does_not_kill_the_writer(tmp_path):
    tier = RaisingDiskTier(tmp_path, 1 << 20)
    queue = WriteBehindQueue(tier, capacity=8)
    outcomes: list[bool] = []
    for i in range(3):
        queue.submit(WriteJob(make_key(i), b"abc", META, on_done=outcomes.append))
    assert queue.flush(10)
    assert outcomes == [False, False, False]
    assert queue.failed_total == 3
    queue.close()
    assert not queue.submit(WriteJob(make_key(9), b"abc", META))  # closed


def test_tier_stats_count_errors_by_kind():
    stats = TierStats(tier="x")
    stats.count_error("timeout")
    stats.count_error("timeout")
    stats.count_error("refused")
    assert stats.errors_total == {"timeout": 2, "refused": 1}
