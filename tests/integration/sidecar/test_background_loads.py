"""The worker's background loads (``load_kv_async``) against a real sidecar:
loaded on their own session and thread, every request reported finished
exactly once, failures reported as vLLM takes them."""

from __future__ import annotations

import hashlib
import time
from dataclasses import replace
from typing import Any

import torch

from kvstrata.connector.async_loads import FinishedLoads
from kvstrata.connector.metadata import ChunkTransfer, KVStrataMetadata, RequestTransfer


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
        done = w.take_finished()  # no sidecar call needed: reported at once
        assert done.req_ids == done.failed_req_ids == {"unplanned"}
    finally:
        w.close()


def test_a_stopped_sidecar_fails_background_loads_within_the_deadline(
    sidecar: Any, kit: Any
) -> None:
    """SIGSTOP: the background session's call runs into load_timeout_seconds;
    vLLM's step never waits for it, and the request is still reported."""
    w = kit.host_worker(sidecar, model="background-test", load_timeout_s=1.0)
    try:
        reqs = kit.chunk_requests("bg-stopped", 1, 2)
        w.save(KVStrataMetadata(saves=reqs))
        sidecar.pause()
        try:
            started = time.monotonic()
            w.start_load(KVStrataMetadata(loads=_background(reqs)))
            assert time.monotonic() - started < 0.5  # the step did not wait
            done = _finished(w, 1, timeout=10)
        finally:
            sidecar.resume()
        assert done.req_ids == {"req-0"}
        assert w.take_load_errors() == set(
            reqs[0].chunks[0].block_ids + reqs[0].chunks[1].block_ids
        )
    finally:
        w.close()
