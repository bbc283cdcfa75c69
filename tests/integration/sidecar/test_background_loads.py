"""The worker's background loads (``load_kv_async``) against a real sidecar:
loaded on their own session and thread, every request reported finished
exactly once, failures reported as vLLM takes them."""

from __future__ import annotations

import hashlib
import time
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import torch

from kvstrata.connector.async_loads import FinishedLoads
from kvstrata.connector.metadata import ChunkTransfer, KVStrataMetadata, RequestTransfer
from kvstrata.connector.scheduler import KVStrataScheduler
from kvstrata.connector.settings import LoadAsync


def _background(reqs: list[RequestTransfer]) -> list[RequestTransfer]:
    return [replace(r, asynchronous=True) for r in reqs]


def _finished(w: Any, want: int, timeout: float = 10.0) -> FinishedLoads:
    """Everything reported finished, polled like vLLM does once per step."""
    total = FinishedLoads()
    deadline = time.monotonic() + timeout
    while len(total.req_ids) < want:
        assert time.monotonic() < deadline, f"{len(total.req_ids)} of {want} reported"
        done = w.take_finished()
        total.req_ids |= done.req_ids
        total.failed_req_ids |= done.failed_req_ids
        total.failed_blocks |= done.failed_blocks
        time.sleep(0.01)
    return total


def _kv_bytes(w: Any, block_ids: list[int]) -> list[bytes]:
    """The bytes of the given blocks in every layer of the worker's KV."""
    layout = w.layout
    out = []
    for kv in layout.layers:
        for b in block_ids:
            out.append(
                kv.select(layout.block_dim, b).contiguous().view(torch.uint8).numpy().tobytes()
            )
    return out


def test_background_loads_fill_the_same_bytes_as_inline_loads(sidecar: Any, kit: Any) -> None:
    w = kit.host_worker(sidecar, model="background-test")
    try:
        reqs = kit.chunk_requests("bg-bytes", 2, 2)
        w.save(KVStrataMetadata(saves=reqs))
        assert w.counters.saved_chunks == 4, w.client.errors
        blocks = [b for r in reqs for c in r.chunks for b in c.block_ids]
        saved = _kv_bytes(w, blocks)
        for kv in w.layout.layers:  # wipe the blocks, then load them back
            kv.zero_()
        w.start_load(KVStrataMetadata(loads=_background(reqs)))
        w.save(None)  # the step ends; the background job needs none of it
        done = _finished(w, 2)
        assert done.req_ids == {"req-0", "req-1"}
        assert not done.failed_req_ids and not done.failed_blocks
        assert w.take_load_errors() == set()
        assert _kv_bytes(w, blocks) == saved
        assert w.counters.async_loads == 2 and w.counters.loaded_chunks == 4
        kit.wait_until(lambda: sidecar.status()["leases_active"] == 0, 5, "leases released")
        assert w.take_finished().req_ids == set()  # reported once only
    finally:
        w.close()


def test_a_miss_is_reported_as_its_blocks_in_the_same_pass(sidecar: Any, kit: Any) -> None:
    w = kit.host_worker(sidecar, model="background-test")
    try:
        stored = kit.chunk_requests("bg-miss", 1, 2)[0]
        w.save(KVStrataMetadata(saves=[stored]))
        missing = ChunkTransfer(hashlib.sha256(b"never stored").digest(), [30, 31])
        gap = RequestTransfer("gap", [stored.chunks[0], missing, stored.chunks[1]])
        w.start_load(KVStrataMetadata(loads=_background([gap])))
        done = _finished(w, 1)
        assert done.req_ids == {"gap"} and not done.failed_req_ids
        # Loaded up to the miss; the rest goes out with this pass's load errors.
        assert w.take_load_errors() == {30, 31, *stored.chunks[1].block_ids}
        assert w.counters.loaded_chunks == 1 and w.counters.failed_chunks == 2
    finally:
        w.close()


def test_with_several_kv_cache_groups_a_miss_fails_the_whole_request(
    sidecar: Any, kit: Any
) -> None:
    """vLLM takes no block-level errors for hybrid models: the request is a failed
    receive (recomputed whole), and no block id goes out as a load error."""
    w = kit.host_worker(sidecar, model="background-test")
    w.reports.whole_requests = True  # as a worker of a hybrid model's settings
    try:
        missing = ChunkTransfer(hashlib.sha256(b"not there").digest(), [4, 5])
        w.start_load(KVStrataMetadata(loads=_background([RequestTransfer("hybrid", [missing])])))
        done = _finished(w, 1)
        assert done.req_ids == done.failed_req_ids == {"hybrid"}
        assert w.take_load_errors() == set()
    finally:
        w.close()


def test_a_load_the_scheduler_could_not_plan_is_reported_failed(sidecar: Any, kit: Any) -> None:
    w = kit.host_worker(sidecar, model="background-test")
    try:
        unplanned = RequestTransfer("unplanned", [], asynchronous=True, plan_failed=True)
        w.start_load(KVStrataMetadata(loads=[unplanned]))
        done = _finished(w, 1)  # nothing to lease: reported as a whole failure
        assert done.req_ids == done.failed_req_ids == {"unplanned"}
    finally:
        w.close()


def test_a_stopped_sidecar_fails_background_loads_within_the_deadline(
    sidecar: Any, kit: Any
) -> None:
    """SIGSTOP: the background session's call runs into load_timeout_seconds;
    vLLM's step never waits for it, and the request is still reported.

    The step did not wait: start_load returned while the load was still
    unanswered (nothing finished yet; a start_load that waited out the
    deadline would come back with the failure ready to take)."""
    w = kit.host_worker(sidecar, model="background-test", load_timeout_s=3.0)
    try:
        reqs = kit.chunk_requests("bg-stopped", 1, 2)
        w.save(KVStrataMetadata(saves=reqs))
        sidecar.pause()
        try:
            w.start_load(KVStrataMetadata(loads=_background(reqs)))
            assert w.take_finished().req_ids == set()  # still in flight
            done = _finished(w, 1, timeout=30)
        finally:
            sidecar.resume()
        assert done.req_ids == {"req-0"}
        assert w.take_load_errors() == set(
            reqs[0].chunks[0].block_ids + reqs[0].chunks[1].block_ids
        )
    finally:
        w.close()


def test_a_background_load_is_leased_and_copied_a_wave_at_a_time(sidecar: Any, kit: Any) -> None:
    """Waves of one chunk: each request's chunks are asked for in order, one
    PREPARE_RETRIEVE per wave for every request still going, and the bytes
    are those an inline load gives; with the default waves (far larger than
    these chunks) the whole job is one call."""
    w = kit.host_worker(sidecar, model="background-waves")
    try:
        assert w._background is not None and w.layout is not None
        reqs = kit.chunk_requests("bg-waves", 2, 3)
        w.save(KVStrataMetadata(saves=reqs))
        blocks = [b for r in reqs for c in r.chunks for b in c.block_ids]
        saved = _kv_bytes(w, blocks)

        for wave_bytes, calls in ((w.layout.chunk_nbytes, 3), (32 << 20, 1)):
            w._background.wave_bytes = wave_bytes
            for kv in w.layout.layers:
                kv.zero_()
            before = kit.op_counts(sidecar)
            w.start_load(KVStrataMetadata(loads=_background(reqs)))
            done = _finished(w, 2)
            assert not done.failed_req_ids and not done.failed_blocks
            assert _kv_bytes(w, blocks) == saved
            assert kit.op_delta(before, kit.op_counts(sidecar)) == {
                "PREPARE_STORE": 0,
                "COMMIT_STORE": 0,
                "PREPARE_RETRIEVE": calls,
                "RELEASE": 1,  # every wave's leases, once the job is done
            }
        assert w.counters.loaded_chunks == 12
    finally:
        w.close()


def test_a_request_cut_short_in_a_wave_is_asked_for_no_more(sidecar: Any, kit: Any) -> None:
    """Waves of one chunk: a miss in the second wave ends that request there
    (its third chunk is never asked for: no third wave) while the other
    request of the job loads to its end."""
    w = kit.host_worker(sidecar, model="background-waves")
    try:
        assert w._background is not None and w.layout is not None
        w._background.wave_bytes = w.layout.chunk_nbytes
        short, other = kit.chunk_requests("bg-cut", 2, 3)
        w.save(KVStrataMetadata(saves=[short, other]))
        missing = ChunkTransfer(hashlib.sha256(b"bg-cut never stored").digest(), [30, 31])
        cut = RequestTransfer("cut", [short.chunks[0], missing, short.chunks[2]])
        two = RequestTransfer("two", other.chunks[:2])
        before = kit.op_counts(sidecar)
        w.start_load(KVStrataMetadata(loads=_background([cut, two])))
        done = _finished(w, 2)
        assert done.req_ids == {"cut", "two"} and not done.failed_req_ids
        assert w.take_load_errors() == {30, 31, *short.chunks[2].block_ids}
        assert w.counters.loaded_chunks == 1 + 2 and w.counters.failed_chunks == 2
        assert kit.op_delta(before, kit.op_counts(sidecar))["PREPARE_RETRIEVE"] == 2
    finally:
        w.close()


def test_an_idle_step_waits_for_a_load_in_flight_and_a_busy_one_never(
    sidecar: Any, kit: Any
) -> None:
    """A step in which vLLM scheduled nothing, asked for finished loads while
    one is in flight (the sidecar stopped), waits for it a moment; a step
    with work never does, nor an idle one with nothing in flight."""
    w = kit.host_worker(sidecar, model="background-idle")
    try:
        reqs = kit.chunk_requests("bg-idle", 1, 1)
        w.save(KVStrataMetadata(saves=reqs))
        assert w.take_finished(idle=True).req_ids == set()
        assert w.counters.idle_waits == 0  # nothing in flight
        sidecar.pause()
        try:
            w.start_load(KVStrataMetadata(loads=_background(reqs)))
            assert w.take_finished(idle=False).req_ids == set()
            assert w.counters.idle_waits == 0
            assert w.take_finished(idle=True).req_ids == set()  # still stopped
            assert w.counters.idle_waits == 1
        finally:
            sidecar.resume()
        done = _finished(w, 1)
        assert done.req_ids == {"req-0"} and not done.failed_blocks
    finally:
        w.close()


# -- the scheduler's side ---------------------------------------------------------------


def _request(req_id: str, hashes: list[bytes], kit: Any) -> Any:
    """What the scheduler reads of a vLLM Request (chunk i keyed by its last block)."""
    blocks = [b for h in hashes for b in (b"\1" * 32, h)]
    return SimpleNamespace(
        request_id=req_id,
        num_prompt_tokens=len(hashes) * kit.WORKER_CHUNK + 1,
        block_hashes=blocks,
        cache_salt=None,
    )


def _stored_chunk_hashes(sidecar: Any, kit: Any, model: str) -> list[bytes]:
    """Two chunks saved by a worker of ``model``; their hashes."""
    w = kit.host_worker(sidecar, model=model)
    reqs = kit.chunk_requests(model, 1, 2)
    w.save(KVStrataMetadata(saves=reqs))
    assert w.counters.saved_chunks == 2, w.client.errors
    w.close()
    return [c.chunk_hash for c in reqs[0].chunks]


def _matched(scheduler: KVStrataScheduler, req: Any, kit: Any) -> int:
    def answer() -> tuple[int] | None:
        n = scheduler.get_num_new_matched_tokens(req, 0)
        return None if n is None else (n,)

    return kit.wait_until(answer, 10, "the lookup's answer", step=0.005)[0]


def test_the_scheduler_loads_hits_below_l1_in_the_background(sidecar: Any, kit: Any) -> None:
    """After a restart the chunks are in L2 only: the hit loads in the
    background, sent with the next step although vLLM schedules nothing for
    the request; promoted into L1, the next hit loads inline."""
    settings = kit.worker_settings(sidecar, model="background-sched")
    hashes = _stored_chunk_hashes(sidecar, kit, "background-sched")
    sidecar.restart()  # L1 empty; L2 holds both chunks
    scheduler = KVStrataScheduler(settings)
    try:
        req = _request("below-l1", hashes, kit)
        assert _matched(scheduler, req, kit) == 2 * kit.WORKER_CHUNK
        assert scheduler.loads_async("below-l1")
        scheduler.update_state_after_alloc(req, [[0, 1, 2, 3]], 2 * kit.WORKER_CHUNK)
        meta = scheduler.build_connector_meta(kit.empty_step())
        assert [(t.req_id, t.asynchronous, len(t.chunks)) for t in meta.loads] == [
            ("below-l1", True, 2)
        ]
        assert meta.idle  # vLLM scheduled no token: the workers may wait for the load
        assert scheduler.build_connector_meta(kit.empty_step()).loads == []  # sent once
        scheduler.request_finished("below-l1")

        # Landed, not only reserved: an L1 entry counts among the objects as
        # soon as its promotion reserves it, and a lookup sees it only once ready.
        kit.wait_until(
            lambda: (
                sidecar.status()["tiers"]["l1"]["objects"] >= 2
                and sidecar.metric("kvstrata_queued_loads") == 0
            ),
            10,
            "the promotions",
        )
        again = _request("in-l1", hashes, kit)
        assert _matched(scheduler, again, kit) == 2 * kit.WORKER_CHUNK
        assert not scheduler.loads_async("in-l1")
        scheduler.request_finished("in-l1")
    finally:
        scheduler.close()


def test_the_load_async_setting_and_a_failed_background_load(sidecar: Any, kit: Any) -> None:
    """``always`` loads even L1 hits in the background, ``never`` not even L2
    ones; a request whose background load failed is not offered the same hit
    again (vLLM asks again after a failed receive)."""
    settings = kit.worker_settings(sidecar, model="background-mode", load_async=LoadAsync.ALWAYS)
    hashes = _stored_chunk_hashes(sidecar, kit, "background-mode")
    scheduler = KVStrataScheduler(settings)
    try:
        req = _request("r", hashes, kit)
        assert _matched(scheduler, req, kit) == 2 * kit.WORKER_CHUNK
        assert scheduler.loads_async("r")
        scheduler.update_state_after_alloc(req, [[0, 1, 2, 3]], 2 * kit.WORKER_CHUNK)
        assert scheduler.build_connector_meta(kit.empty_step()).loads[0].asynchronous
        scheduler.background_loads_finished({"r"}, {"r"}, set())  # a failed receive
        assert scheduler.get_num_new_matched_tokens(req, 0) == 0
    finally:
        scheduler.close()

    sidecar.restart()  # L2 only now
    never = KVStrataScheduler(replace(settings, load_async=LoadAsync.NEVER))
    try:
        assert _matched(never, _request("n", hashes, kit), kit) == 2 * kit.WORKER_CHUNK
        assert not never.loads_async("n")
    finally:
        never.close()


def test_the_loader_sets_its_session_up_when_the_kv_is_registered(sidecar: Any, kit: Any) -> None:
    """Ordered by events: the loader's HELLO comes after the KV registration
    and before any load is asked; its first job then reuses that session.
    On CPU the step's own session is set up at registration too (its arena
    mapping populated before vLLM serves: test_arena_populate.py)."""
    w = kit.host_worker(sidecar, model="background-test")
    try:

        def sessions() -> list[str]:
            return [c["client_id"] for c in sidecar.status()["clients"]]

        assert w.client.available()  # connected by register_kv_caches itself
        kit.wait_until(lambda: len(sessions()) == 2, 10, "the loader's HELLO")
        [loader_id] = [c for c in sessions() if c != w.client.client_id]
        reqs = kit.chunk_requests("bg-early", 1, 2)
        w.save(KVStrataMetadata(saves=reqs))
        w.start_load(KVStrataMetadata(loads=_background(reqs)))
        w.save(None)
        done = _finished(w, 1)
        assert not done.failed_req_ids and not done.failed_blocks
        assert w.counters.loaded_chunks == 2
        assert sorted(sessions()) == sorted([loader_id, w.client.client_id])
        assert sidecar.log().count(f"HELLO from {loader_id}") == 1
        assert sidecar.log().count(f"HELLO from {w.client.client_id}") == 1
    finally:
        w.close()
