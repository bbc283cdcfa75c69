"""One round trip per step: the worker saves (and loads) all of a step's
requests in one PREPARE_* call and one COMMIT_STORE / RELEASE, counted at a
real sidecar by its per-op counters."""

from __future__ import annotations

import hashlib
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kvstrata.connector.metadata import ChunkTransfer, KVStrataMetadata, RequestTransfer

OPS = ("PREPARE_STORE", "COMMIT_STORE", "PREPARE_RETRIEVE", "RELEASE")


def op_counts(sidecar: Any) -> dict[str, float]:
    counts = dict.fromkeys(OPS, 0.0)
    for family in text_string_to_metric_families(sidecar.get("/metrics")):
        for sample in family.samples:
            op = sample.labels.get("op")
            if sample.name == "kvstrata_operation_duration_seconds_count" and op in counts:
                counts[op] = sample.value
    return counts


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    return {op: int(after[op] - before[op]) for op in OPS}


def test_a_step_of_several_requests_saves_and_loads_in_one_round_trip_each(
    sidecar: Any, kit: Any
) -> None:
    w = kit.host_worker(sidecar, model="batching-test")
    try:
        reqs = kit.chunk_requests("one-trip", 3, 2)
        before = op_counts(sidecar)
        w.save(KVStrataMetadata(saves=reqs))
        assert w.counters.saved_chunks == 6, w.client.errors
        assert delta(before, op_counts(sidecar)) == {
            "PREPARE_STORE": 1,
            "COMMIT_STORE": 1,
            "PREPARE_RETRIEVE": 0,
            "RELEASE": 0,
        }

        before = op_counts(sidecar)
        w.start_load(KVStrataMetadata(loads=reqs))
        w.save(None)  # end of the step: copies done, leases released
        assert w.take_load_errors() == set()
        assert w.counters.loaded_chunks == 6
        assert delta(before, op_counts(sidecar)) == {
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
        before = op_counts(small)
        w.save(KVStrataMetadata(saves=kit.chunk_requests("budget", 3, 2)))
        assert w.counters.saved_chunks == 6, (w.counters, w.client.errors)
        d = delta(before, op_counts(small))
        assert d["PREPARE_STORE"] == d["COMMIT_STORE"] == 3
    finally:
        w.close()
