"""Write-behind's backlog (sidecar/writeback.py): writes parked while the pin
budget is spent go as soon as a writer is free again, whatever the outcome
of the write that freed it."""

from __future__ import annotations

import threading

from kvstrata.sidecar.engine import StorageManager
from kvstrata.sidecar.objformat import ChunkMeta
from kvstrata.sidecar.tiers.disk import DiskTier
from kvstrata.testing.poll import wait_until

from ..conftest import engine_config, make_key, payload_for

CHUNK = 4096
META = ChunkMeta("uint8", (CHUNK,))
# engine_config's L1 is 1 MiB: write-behind pins at most half of it.
PIN_BUDGET_CHUNKS = (1 << 20) // 2 // CHUNK


class OutageDirTier(DiskTier):
    """FaultInjecting: a directory standing in as the shared tier, whose writes
    wait at a gate the test opens and whose first ``failures`` writes then
    fail (an outage that ends; a real server's cannot be timed to a write)."""

    name = "shared"

    def __init__(self, *args, failures: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.failures = failures
        self._outage = threading.Lock()

    def put(self, key, payload, meta):
        self.gate.wait(30)
        with self._outage:
            if self.failures:
                self.failures -= 1
                return False
        return super().put(key, payload, meta)


def test_parked_writes_go_after_failed_writes_without_another_store(tmp_path):
    parked = 40
    shared = OutageDirTier(tmp_path / "shared", 1 << 22, failures=PIN_BUDGET_CHUNKS)
    config = engine_config(
        tmp_path,
        l2={"enabled": False},
        shared={"write_queue_depth": 4 * PIN_BUDGET_CHUNKS, "writer_threads": 1},
    )
    keys = [make_key(i) for i in range(PIN_BUDGET_CHUNKS + parked)]
    with StorageManager(config, shared_tier=shared) as engine:
        for key in keys:
            assert engine.put(key, payload_for(key, CHUNK), META)
        gauges = engine.stats().gauges
        assert gauges.writeback_pinned_bytes == PIN_BUDGET_CHUNKS * CHUNK
        assert gauges.writeback_backlog == parked
        # Every write holding the budget fails; nothing is stored after that.
        shared.gate.set()
        wait_until(
            lambda: all(shared.contains_many(keys[PIN_BUDGET_CHUNKS:])),
            30,
            "the parked writes stored after the failed ones",
        )
        assert shared.contains_many(keys[:PIN_BUDGET_CHUNKS]) == [False] * PIN_BUDGET_CHUNKS
        assert engine.stats().gauges.writeback_backlog == 0
        assert engine.stats().counters.writeback_skipped_total == 0
        assert engine.flush(10)
        assert engine.stats().gauges.writeback_pinned_bytes == 0
