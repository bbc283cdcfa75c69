"""SAVE_BLOCKS / LOAD_BLOCKS carry the client's deadline, and the sidecar
touches no block past it.

Why: the worker stops waiting at its call deadline, reports the chunks as
dropped (or, for a load, missed: vLLM recomputes them), and vLLM may hand
those blocks to other work at once; a sidecar that copied later would save
another request's KV under these keys, or write into blocks being
recomputed. A real server on its own thread and a real client over its
real ZeroMQ socket; the GPU is :class:`HeldEventDevice`, a test double over
:class:`SharedMemoryDevice` that waits for vLLM's event as the CUDA device
does (on the host, polling, stopping when told to) until the test completes
the event.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from kvstrata.connector.client import SidecarClient
from kvstrata.connector.client_ipc import COPY_MARGIN_S, sidecar_deadline_ms
from kvstrata.sidecar import protocol as p
from kvstrata.sidecar.keys import ChunkKey, Namespace
from kvstrata.sidecar.transfer.plan import CopyPlan
from kvstrata.sidecar.transfer_mode import TransferMode
from kvstrata.testing.rawpeer import RawPeer
from kvstrata.testing.shmdevice import SharedKV, SharedMemoryDevice
from kvstrata.testing.shmsidecar import ServedOnThread

GPU_UUID = "GPU-00000000-0000-0000-0000-0000deadline"
NAMESPACE = Namespace(model="copy-deadline-test", block_size=16, chunk_size=32)
NUM_BLOCKS = 8
EVENT = b"\x07" * p.IPC_HANDLE_BYTES  # vLLM's interprocess event, as its handle


class HeldEventDevice(SharedMemoryDevice):
    """A save waits for its event until :meth:`complete` (module docstring);
    counts the copies made and the saves finished either way."""

    def __init__(self, arena_base: int) -> None:
        super().__init__(arena_base)
        self.completed: set[bytes] = set()
        self.waiting = threading.Event()
        self.gathers = 0
        self.finished = 0
        self.scatters = 0

    def complete(self, event: bytes) -> None:
        self.completed.add(event)

    def gather(
        self,
        plan: CopyPlan,
        block_ids: Sequence[int],
        chunk_addresses: Sequence[int],
        blocks_per_chunk: int,
        after_event: bytes | None,
        cancelled: Callable[[], bool] | None = None,
    ) -> None:
        try:
            if after_event is not None:
                self.waiting.set()
                while after_event not in self.completed:
                    if cancelled is not None and cancelled():
                        raise RuntimeError("told to stop while waiting for vLLM's event")
                    time.sleep(0.001)
            self.gathers += 1
            super().gather(plan, block_ids, chunk_addresses, blocks_per_chunk, None)
        finally:
            self.finished += 1

    def scatter(
        self,
        plan: CopyPlan,
        block_ids: Sequence[int],
        chunk_addresses: Sequence[int],
        blocks_per_chunk: int,
        after_event: bytes | None = None,
    ) -> None:
        self.scatters += 1
        super().scatter(plan, block_ids, chunk_addresses, blocks_per_chunk, None)


class Served(ServedOnThread):
    """The real server over :class:`HeldEventDevice`; ``workers``: its pool's threads."""

    def __init__(self, root: Path, workers: int = 4) -> None:
        super().__init__(root, GPU_UUID, device=HeldEventDevice, workers=workers)
        self.device: HeldEventDevice

    def close(self) -> None:
        self.device.complete(EVENT)
        super().close()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    made = Served(tmp_path)
    yield made
    made.close()


@pytest.fixture
def one_worker(tmp_path: Path) -> Iterator[Served]:
    made = Served(tmp_path, workers=1)
    yield made
    made.close()


@pytest.fixture
def registration(shared_kv: Callable[..., SharedKV]) -> p.RegisterKVRequest:
    return shared_kv(GPU_UUID, NUM_BLOCKS).registration()


def keys(n: int, tag: str) -> list[ChunkKey]:
    fp = NAMESPACE.fingerprint()
    return [ChunkKey(fp + hashlib.sha256(f"{tag}/{i}".encode()).digest()) for i in range(n)]


def test_the_deadline_sent_leaves_the_client_a_margin_and_crosses_the_wire() -> None:
    assert sidecar_deadline_ms(0.5) == int((0.5 - COPY_MARGIN_S) * 1000)
    assert sidecar_deadline_ms(0.05) == 40  # a fifth of a short remainder
    assert sidecar_deadline_ms(-1.0) == 1  # never 0, which says "none"
    body = p.SaveBlocksRequest(keys=keys(1, "wire"), block_ids=[[1, 2]], owner="o", deadline_ms=400)
    assert p.SaveBlocksRequest.from_wire(body.to_wire()).deadline_ms == 400
    with pytest.raises(p.ProtocolError, match="deadline_ms"):
        p.LoadBlocksRequest.from_wire({**body.to_wire(), "deadline_ms": -5})


def test_a_save_whose_event_outlasts_the_clients_deadline_is_never_copied(
    served: Served, registration: p.RegisterKVRequest, kit: Any
) -> None:
    client = SidecarClient(
        served.endpoint,
        NAMESPACE,
        role="worker",
        call_timeout_s=0.5,
        transfer_mode=TransferMode.IPC,
    )
    try:
        client.register_kv(registration)
        assert client.ping() and client.ipc_granted
        saved = client.ipc.save_blocks(keys(2, "late"), [[1, 2], [3, 4]], EVENT, "step")
        # The client has given up (no answer, or every chunk not committed) ...
        assert saved is None or not any(saved)
        assert served.device.waiting.is_set()
        # ... and vLLM's forward pass ends only now, its blocks free for other work.
        served.device.complete(EVENT)
        kit.wait_until(lambda: served.device.finished == 1, 10, "the save to end")
        assert served.device.gathers == 0  # not one byte read after the client's deadline
        assert served.ipc.gpu_stats()["expired"] == {"save": 1}
        assert served.ipc.gpu_stats()["copy_failures"] == {}  # not a GPU fault
        assert client.ping()  # the session serves on
    finally:
        client.close()


def test_a_load_that_waited_past_the_clients_deadline_is_released_unloaded(
    one_worker: Served, registration: p.RegisterKVRequest, kit: Any
) -> None:
    served = one_worker
    client = SidecarClient(
        served.endpoint,
        NAMESPACE,
        role="worker",
        call_timeout_s=0.5,
        transfer_mode=TransferMode.IPC,
    )
    holder = RawPeer(served.endpoint)
    try:
        client.register_kv(registration)
        assert client.ping() and client.ipc_granted
        stored = keys(2, "load")
        assert client.ipc.save_blocks(stored, [[1, 2], [3, 4]], None, "save") == [True, True]
        # Another session's save, sent without a deadline, holds the pool's only
        # thread while it waits for its vLLM's event.
        holder.hello(NAMESPACE.fingerprint(), client_id="holder", transfer_mode="ipc")
        assert holder.call(p.REGISTER_KV, registration.to_wire(), request_id=2)[2] is True
        held = {"keys": keys(1, "held"), "block_ids": [[5, 6]], "owner": "h", "after_event": EVENT}
        holder.send_request(p.SAVE_BLOCKS, held, request_id=3)
        kit.wait_until(served.device.waiting.is_set, 10, "the held save to wait")

        # The load waits behind it, past the client's deadline: the client gives up.
        assert client.ipc.load_blocks(stored, [[6, 7], [0, 5]], "load") is None
        served.device.complete(EVENT)  # the pool's thread is free only now
        assert holder.receive()[2] is True
        kit.wait_until(  # the load's turn came: it was either abandoned or copied
            lambda: served.ipc.gpu_stats().get("expired") or served.device.scatters,
            10,
            "the load to be handled",
        )
        assert served.device.scatters == 0  # no block written after the client gave up
        assert served.ipc.gpu_stats()["expired"] == {"load": 1}
    finally:
        holder.close()
        client.close()
