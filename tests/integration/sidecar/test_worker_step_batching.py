"""One round trip per step: the worker saves (and loads) all of a step's
requests in one PREPARE_* call and one COMMIT_STORE / RELEASE, counted at a
real sidecar by its per-op counters."""

from __future__ import annotations

import hashlib
from typing import Any

from kvstrata.connector.metadata import ChunkTransfer, KVStrataMetadata, RequestTransfer


def test_a_step_of_several_requests_saves_and_loads_in_one_round_trip_each(
    sidecar: Any, kit: Any
) -> None:
    w = kit.host_worker(sidecar, model="batching-test")
    try:
        reqs = kit.chunk_requests("one-trip", 3, 2)
        before = kit.op_counts(sidecar)
        w.save(KVStrataMetadata(saves=reqs))
        assert w.counters.saved_chunks == 6, w.client.errors
        assert kit.op_delta(before, kit.op_counts(sidecar)) == {
            "PREPARE_STORE": 1,
            "COMMIT_STORE": 1,
            "PREPARE_RETRIEVE": 0,
            "RELEASE": 0,
        }

        before = kit.op_counts(sidecar)
        w.start_load(KVStrataMetadata(loads=reqs))
        w.save(None)  # end of the step: copies done, leases released
        assert w.take_load_errors() == set()
        assert w.counters.loaded_chunks == 6
        assert kit.op_delta(before, kit.op_counts(sidecar)) == {
            "PREPARE_STORE": 0,
            "COMMIT_STORE": 0,
            "PREPARE_RETRIEVE": 1,
            "RELEASE": 1,
        }
        assert sidecar.status()["leases_active"] == 0
    finally:
        w.close()


def test_a_miss_in_one_request_of_a_step_ends_only_that_requests_load(
    sidecar: Any, kit: Any
) -> None:
    w = kit.host_worker(sidecar, model="batching-test")
    try:
        stored = kit.chunk_requests("one-miss", 3, 2)
        w.save(KVStrataMetadata(saves=stored))
        missing = hashlib.sha256(b"never stored").digest()
        gap = RequestTransfer(
            "gap", [stored[1].chunks[0], ChunkTransfer(missing, [40, 41]), stored[1].chunks[1]]
        )
        w.start_load(KVStrataMetadata(loads=[stored[0], gap, stored[2]]))
        w.save(None)
        assert w.counters.loaded_chunks == 2 + 1 + 2
        assert w.take_load_errors() == {40, 41, *stored[1].chunks[1].block_ids}
        assert sidecar.status()["leases_active"] == 0
    finally:
        w.close()


def test_a_step_beyond_the_sessions_write_budget_is_saved_in_several_round_trips(
    sidecar_factory: Any, kit: Any
) -> None:
    probe = sidecar_factory("probe").start()
    nbytes = kit.host_worker(probe, model="batching-test").layout.chunk_nbytes  # type: ignore[union-attr]
    probe.stop()
    arena = 16 << 20  # the test sidecars' L1
    small = sidecar_factory(
        "small", {"server": {"session_write_fraction": 2 * nbytes / arena}}
    ).start()
    w = kit.host_worker(small, model="batching-test")
    try:
        assert w.client.ping() and w.client.write_budget == 2 * nbytes
        before = kit.op_counts(small)
        w.save(KVStrataMetadata(saves=kit.chunk_requests("budget", 3, 2)))
        assert w.counters.saved_chunks == 6, (w.counters, w.client.errors)
        d = kit.op_delta(before, kit.op_counts(small))
        assert d["PREPARE_STORE"] == d["COMMIT_STORE"] == 3
    finally:
        w.close()
