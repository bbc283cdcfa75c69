"""A load whose copies outlive its leases is recomputed, never served.

A read lease pins its arena slot for the sidecar's ``lease_seconds``; after
that the sidecar may give the slot to another chunk. A worker thread
starved of CPU can reach its copy later than that (found by the chaos soak:
a wrong token under overlapping faults with ``lease_seconds: 5``). Here the
copy is held back until the sidecar has expired the lease and other chunks
have been stored over the slot -- the hold is the one stand-in, a
``_copy_in`` double that waits for those two events before the real copy --
and the worker must then report the chunk as not loaded (vLLM recomputes
it), never hand vLLM the other chunk's bytes.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvstrata.connector.metadata import ChunkTransfer, KVStrataMetadata, RequestTransfer
from kvstrata.connector.worker import KVStrataWorker
from kvstrata.testing.kvlayouts import vllm_layers
from kvstrata.testing.workers import case_settings

LEASE_SECONDS = 0.3  # short, so the test waits little for the expiry it orders by
CASE_NAME = "LBNHC"  # vLLM's default layout


def expired_leases(sidecar: Any) -> float:
    found = re.search(r"^kvstrata_leases_expired_total (\S+)$", sidecar.get("/metrics"), re.M)
    return float(found.group(1)) if found else 0.0


def new_worker(endpoint: str, case: Any) -> KVStrataWorker:
    worker = KVStrataWorker(case_settings(endpoint, case, "lease-test"), None)  # type: ignore[arg-type]
    worker.register_kv_caches(case.layers)
    assert worker.layout is not None
    return worker


def chunk(test: str, i: int, blocks: list[int]) -> ChunkTransfer:
    return ChunkTransfer(hashlib.sha256(f"{test}/{i}".encode()).digest(), blocks)


@pytest.fixture
def sidecar(kit: Any, tmp_path: Any) -> Iterator[Any]:
    """A sidecar with a 1 MiB L1 and short leases."""
    sc = kit.Sidecar(
        tmp_path / "sc", {"l1": {"size_bytes": "1Mi"}, "server": {"lease_seconds": LEASE_SECONDS}}
    )
    sc.start()
    yield sc
    sc.stop()
    sc.cleanup()


def test_a_copy_that_outlives_its_lease_is_not_loaded(kit: Any, sidecar: Any) -> None:
    case = vllm_layers(CASE_NAME, dtype=torch.float16)
    saver = new_worker(sidecar.endpoint, case)
    loader = new_worker(sidecar.endpoint, case)
    try:
        wanted = chunk("wanted", 0, [3, 4])
        saver.save(KVStrataMetadata(saves=[RequestTransfer("save", [wanted])]))
        assert saver.counters.saved_chunks == 1, saver.client.errors
        slots = (1 << 20) // saver.layout.chunk_nbytes + 2  # more than L1 holds
        real_copy_in = loader._copy_in

        def copy_after_the_slot_was_reused(work: Any) -> None:
            """Double: a copy reached only after the lease expired and the
            slot was written again (a starved thread's)."""
            kit.wait_until(lambda: expired_leases(sidecar) >= 1, 30.0, "the lease to expire")
            for i in range(slots):  # other chunks, with other bytes, over every slot
                other = chunk("other", i, [5 + i % 2, 6 - i % 2])
                saver.save(KVStrataMetadata(saves=[RequestTransfer(f"o{i}", [other])]))
            real_copy_in(work)

        loader._copy_in = copy_after_the_slot_was_reused  # type: ignore[method-assign]
        loader.start_load(
            KVStrataMetadata(
                loads=[RequestTransfer("load", [ChunkTransfer(wanted.chunk_hash, [7, 8])])]
            )
        )
        loader.save(None)  # end of the step
        assert saver.counters.saved_chunks > slots // 2, "the slot was not written again"
        assert loader.counters.loaded_chunks == 0
        assert loader.take_load_errors() == {7, 8}  # the blocks vLLM must recompute
    finally:
        loader.close()
        saver.close()


def test_a_save_too_late_to_copy_never_writes_into_a_slot_another_chunk_now_owns(
    kit: Any, sidecar: Any
) -> None:
    # A save's copy reached after its write lease expired would land in a slot
    # the sidecar may have given to another session's chunk by then, silently
    # changing that chunk. The sidecar keeps an expired write lease's slot
    # pinned until its writer is done (and the worker checks before each copy).
    case = vllm_layers(CASE_NAME, dtype=torch.float16)
    late = new_worker(sidecar.endpoint, case)
    other = new_worker(sidecar.endpoint, case)
    try:
        capacity = (1 << 20) // other.layout.chunk_nbytes
        for i in range(capacity):  # L1 full: a freed slot is the only free space
            filler = chunk("filler", i, [0, 1])
            other.save(KVStrataMetadata(saves=[RequestTransfer(f"f{i}", [filler])]))
        copies = late.transfer.copies
        real_saving = copies.saving
        stalled: list[bool] = []

        @contextlib.contextmanager
        def saving_once_the_leases_expired() -> Iterator[None]:
            """Double: the first copy is reached only after the leases expired
            and another session stored chunks in the freed slots."""
            if not stalled:
                stalled.append(True)
                kit.wait_until(lambda: expired_leases(sidecar) >= 2, 30.0, "the leases to expire")
                for i in range(2):
                    theirs = chunk("theirs", i, [9, 10])
                    other.save(KVStrataMetadata(saves=[RequestTransfer(f"t{i}", [theirs])]))
            with real_saving():
                yield

        copies.saving = saving_once_the_leases_expired  # type: ignore[method-assign]
        mine = [chunk("mine", 0, [3, 4]), chunk("mine", 1, [5, 6])]
        late.save(KVStrataMetadata(saves=[RequestTransfer("late", mine)]))
        assert late.counters.saved_chunks == 0  # its leases had expired
        theirs = [chunk("theirs", i, [7, 8]) for i in range(2)]
        want = block_bytes(case, [9, 10])
        for i, c in enumerate(theirs):
            other.start_load(KVStrataMetadata(loads=[RequestTransfer(f"l{i}", [c])]))
            other.save(None)
            if other.take_load_errors():
                continue  # not in L1 any more: nothing to compare
            assert block_bytes(case, [7, 8]) == want, f"their chunk {i} was overwritten"
        assert other.counters.loaded_chunks >= 1, "none of their chunks could be read back"
    finally:
        late.close()
        other.close()


def block_bytes(case: Any, blocks: list[int]) -> list[bytes]:
    """Every layer's bytes of ``blocks``."""
    return [
        kv.select(case.block_dim, b).contiguous().view(torch.uint8).numpy().tobytes()
        for kv in case.layers.values()
        for b in blocks
    ]
