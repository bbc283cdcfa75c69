"""ipc transfer mode through a real server, real client and real ZeroMQ sockets.

No GPU here: the sidecar's device is :class:`SharedMemoryDevice`, a named
test double whose "IPC handles" name shared-memory segments and whose copies
run the host build of the csrc kernels. The protocol, registration, copy
plans, engine slots and session life cycle are the real code. A sidecar
process without CUDA is also asked for ipc and must grant host mode.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstrata.connector.client import SidecarClient
from kvstrata.sidecar import protocol as p
from kvstrata.sidecar.config import config_from_dict
from kvstrata.sidecar.engine import StorageManager
from kvstrata.sidecar.keys import ChunkKey, Namespace
from kvstrata.sidecar.transfer.ipc import IpcTransfers
from kvstrata.sidecar.transfer_mode import TransferMode
from kvstrata.testing.shmdevice import SharedKV, SharedMemoryDevice
from kvstrata.testing.shmsidecar import ServedOnThread

GPU_UUID = "GPU-00000000-0000-0000-0000-00000000test"
NAMESPACE = Namespace(model="ipc-test", block_size=16, chunk_size=32)
BLOCKS_PER_CHUNK = 2
POISON = 0x5A


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[ServedOnThread]:
    sc = ServedOnThread(tmp_path, GPU_UUID)
    yield sc
    sc.close()


@pytest.fixture
def kv(shared_kv: Callable[..., SharedKV]) -> SharedKV:
    return shared_kv(GPU_UUID)


def keys(n: int, tag: str) -> list[ChunkKey]:
    fp = NAMESPACE.fingerprint()
    return [ChunkKey(fp + hashlib.sha256(f"{tag}/{i}".encode()).digest()) for i in range(n)]


def ipc_client(endpoint: str) -> SidecarClient:
    return SidecarClient(
        endpoint, NAMESPACE, role="worker", call_timeout_s=5.0, transfer_mode=TransferMode.IPC
    )


def test_blocks_saved_and_loaded_by_the_sidecar_come_back_byte_for_byte(
    sidecar: ServedOnThread, kv: SharedKV
) -> None:
    client = ipc_client(sidecar.endpoint)
    try:
        client.register_kv(kv.registration())
        assert client.stats() is not None  # connects: HELLO + REGISTER_KV
        assert client.transfer_mode is TransferMode.IPC
        assert sidecar.device.open_handles == 1  # one allocation for all layers

        ks = keys(2, "round-trip")
        event = b"\x07" * p.IPC_HANDLE_BYTES
        assert client.ipc.save_blocks(ks, [[3, 4], [9, 1]], event, "r1") == [True, True]
        assert sidecar.device.events_waited == [event]  # copies ordered after vLLM's event

        layers = list(kv.case.layers.values())
        for t in layers:
            for b in (6, 7, 0, 11):
                t[b].view(torch.uint8).fill_(POISON)
        assert client.ipc.load_blocks(ks, [[6, 7], [0, 11]], "r2") == 2
        for t in layers:
            for src, dst in ((3, 6), (4, 7), (9, 0), (1, 11)):
                assert torch.equal(kv.block(t, dst), kv.block(t, src))
    finally:
        client.close()


def test_a_load_fills_only_the_stored_prefix_and_skips_negative_block_ids(
    sidecar: ServedOnThread, kv: SharedKV
) -> None:
    client = ipc_client(sidecar.endpoint)
    try:
        client.register_kv(kv.registration())
        stored, missing = keys(1, "prefix"), keys(1, "absent")
        assert client.ipc.save_blocks(stored, [[2, 5]], None, "r1") == [True]
        layers = list(kv.case.layers.values())
        for t in layers:
            for b in (8, 10):
                t[b].view(torch.uint8).fill_(POISON)
        # Block 8 is vLLM's own prefix-cache hit: -1 leaves it alone.
        assert client.ipc.load_blocks(stored + missing, [[-1, 10], [3, 4]], "r2") == 1
        for t in layers:
            assert torch.all(kv.block(t, 8) == POISON)
            assert torch.equal(kv.block(t, 10), kv.block(t, 5))
    finally:
        client.close()


def test_a_background_session_loads_through_the_same_handles(
    sidecar: ServedOnThread, kv: SharedKV, kit: Any
) -> None:
    """ipc background loads: a second session of the worker registers the same
    KV handles (opened once more, closed with it) and the sidecar scatters the
    chunks for it while the first session stays free."""
    from kvstrata.connector.async_loads import AsyncLoads, LoadReports
    from kvstrata.connector.device import copies_for
    from kvstrata.connector.layout import detect_layout
    from kvstrata.connector.metadata import ChunkKeys, ChunkTransfer, RequestTransfer
    from kvstrata.connector.transfer_path import HostPath, IpcPath

    worker, background = ipc_client(sidecar.endpoint), ipc_client(sidecar.endpoint)
    layout = detect_layout(kv.case.layers, kv_cache_layout="LBNHC", blocks_per_chunk=2)
    reports = LoadReports()
    loads = None
    try:
        worker.register_kv(kv.registration())
        background.register_kv(kv.registration())
        ks = keys(2, "background")
        assert worker.ipc.save_blocks(ks, [[3, 4], [9, 1]], None, "r1") == [True, True]
        layers = list(kv.case.layers.values())
        for t in layers:
            for b in (6, 7, 0, 11):
                t[b].view(torch.uint8).fill_(POISON)
        host = HostPath(
            background,
            ChunkKeys([NAMESPACE.fingerprint()]),
            (layout,),
            copies_for(layout.device),
        )
        loads = AsyncLoads(IpcPath(host, kv.registration()), 5.0, reports)
        blocks = [[6, 7], [0, 11]]
        chunks = [ChunkTransfer(bytes(k[-32:]), ids) for k, ids in zip(ks, blocks, strict=True)]
        loads.submit([RequestTransfer("r2", chunks, asynchronous=True)])

        def finished() -> tuple[Any] | None:
            done = reports.take()
            return (done,) if done.req_ids else None

        (done,) = kit.wait_until(finished, 10, "the background load")
        assert done.req_ids == {"r2"} and done.loaded_chunks == 2 and not done.failed_blocks
        assert sidecar.device.open_handles == 2  # one per session
        for t in layers:
            for src, dst in ((3, 6), (4, 7), (9, 0), (1, 11)):
                assert torch.equal(kv.block(t, dst), kv.block(t, src))
        assert worker.ping()  # the first session was never held up
    finally:
        if loads is not None:
            loads.close()
        else:
            background.close()
        worker.close()
    kit.wait_until(lambda: sidecar.device.open_handles == 0, 5, "every handle closed")


def test_one_load_of_several_runs_fills_each_runs_stored_prefix(
    sidecar: ServedOnThread, kv: SharedKV
) -> None:
    """A step's loads in one LOAD_BLOCKS: each run (request) stops at its own
    first miss, and a miss in one run ends no other."""
    client = ipc_client(sidecar.endpoint)
    try:
        client.register_kv(kv.registration())
        a, b = keys(2, "run-a"), keys(2, "run-b")
        assert client.ipc.save_blocks([a[0], a[1], b[1]], [[1, 2], [3, 4], [5, 6]], None, "s") == [
            True,
            True,
            True,
        ]
        layers = list(kv.case.layers.values())
        for t in layers:
            for blk in (7, 8, 9, 10, 11, 0):
                t[blk].view(torch.uint8).fill_(POISON)
        # Run 1: a[0], a[1] (both stored); run 2: b[0] (missing), b[1] (stored, after the miss).
        loaded = client.ipc.load_block_runs(a + b, [[7, 8], [9, 10], [11, 0], [11, 0]], "r", [2, 2])
        assert loaded == [2, 0]
        for t in layers:
            for src, dst in ((1, 7), (2, 8), (3, 9), (4, 10)):
                assert torch.equal(kv.block(t, dst), kv.block(t, src))
            for blk in (11, 0):  # run 2 loaded nothing
                assert torch.all(kv.block(t, blk) == POISON)
        assert client.ipc.load_block_runs(a, [[7, 8], [9, 10]], "r", [1, 2]) is None  # runs != keys
        assert client.errors.get("bad_argument") == 1
    finally:
        client.close()


def test_out_of_range_blocks_are_refused_and_the_sidecar_keeps_serving(
    sidecar: ServedOnThread, kv: SharedKV
) -> None:
    client = ipc_client(sidecar.endpoint)
    try:
        client.register_kv(kv.registration())
        assert client.ipc.save_blocks(keys(1, "bad"), [[2, 12]], None, "r") is None
        assert client.errors.get(p.E_BAD_REQUEST) == 1
        assert client.ipc.save_blocks(keys(1, "bad"), [[2]], None, "r") is None  # too few blocks
        assert client.ipc.save_blocks(keys(1, "good"), [[2, 3]], None, "r") == [True]
    finally:
        client.close()


def test_a_gpu_the_sidecar_cannot_see_leaves_the_client_in_host_mode(
    sidecar: ServedOnThread, kv: SharedKV, caplog: pytest.LogCaptureFixture
) -> None:
    client = ipc_client(sidecar.endpoint)
    try:
        client.register_kv(kv.registration(gpu="GPU-ffffffff"))
        with caplog.at_level("WARNING"):
            assert client.stats() is not None
        assert client.transfer_mode is TransferMode.HOST
        assert client.errors.get("ipc_fallback") == 1
        assert sum("ipc transfer mode unavailable" in r.message for r in caplog.records) == 1
        assert sidecar.device.open_handles == 0
        # Host mode still works on the same session.
        assert client.prepare_store(keys(1, "host"), 64, "uint8", (64,), "r") is not None
    finally:
        client.close()


def test_handles_are_closed_at_once_when_the_client_process_is_killed_and_a_restart_registers_again(
    sidecar: ServedOnThread, kv: SharedKV, kit: Any
) -> None:
    script = f"""
import os, pickle, sys
from kvstrata.connector.client import SidecarClient
from kvstrata.sidecar.keys import Namespace
from kvstrata.sidecar.transfer_mode import TransferMode
reg = pickle.loads(sys.stdin.buffer.read())
c = SidecarClient({sidecar.endpoint!r}, Namespace(model="ipc-test", block_size=16, chunk_size=32),
                  role="worker", call_timeout_s=5.0, transfer_mode=TransferMode.IPC)
c.register_kv(reg)
assert c.stats() is not None and c.transfer_mode is TransferMode.IPC
print("registered", flush=True)
sys.stdin.close()
import time; time.sleep(60)
"""
    import pickle

    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(pickle.dumps(kv.registration()))
        proc.stdin.close()
        assert proc.stdout.readline().strip() == b"registered"
        assert sidecar.device.open_handles == 1
        proc.kill()  # SIGKILL: no goodbye
        proc.wait(timeout=10)
        # Far sooner than the idle timeout (60 s): the liveness socket closed.
        kit.wait_until(lambda: sidecar.device.open_handles == 0, 5.0, "handles closed")
        assert len(sidecar.ipc) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    # A restarted vLLM registers again and is served.
    client = ipc_client(sidecar.endpoint)
    try:
        client.register_kv(kv.registration())
        assert client.ipc.save_blocks(keys(1, "restarted"), [[1, 2]], None, "r") == [True]
        assert client.transfer_mode is TransferMode.IPC and sidecar.device.open_handles == 1
    finally:
        client.close()


def test_a_sidecar_without_cuda_grants_host_mode_with_the_reason(kit: Any, tmp_path: Path) -> None:
    sc = kit.Sidecar(tmp_path / "sc").start()
    try:
        client = SidecarClient(
            sc.endpoint,
            kit.NAMESPACE,
            role="worker",
            call_timeout_s=5.0,
            transfer_mode=TransferMode.IPC,
        )
        try:
            assert client.stats() is not None
            assert client.transfer_mode is TransferMode.HOST
            assert client.errors.get("ipc_fallback") == 1
        finally:
            client.close()
        assert 'kvstrata_errors_total{kind="ipc_fallback"} 1.0' in sc.get("/metrics")
    finally:
        sc.stop()
        sc.cleanup()


def in_process_engine(tmp_path: Path) -> StorageManager:
    """An engine of this process with an 8 MiB L1 (the device doubles copy into it)."""
    config = config_from_dict(
        {"l1": {"size_bytes": "8Mi", "pin_memory": False}, "l2": {"path": str(tmp_path / "l2")}}
    )
    return StorageManager(config)


class HeldCopy:
    """Two events around a device copy a test holds: ``entered`` once the copy
    started, and ``release`` that lets it go on."""

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()

    def hold(self) -> None:
        self.entered.set()
        assert self.release.wait(10)


def test_a_session_ending_during_a_copy_closes_its_handles_only_after_the_copy(
    tmp_path: Path, kv: SharedKV
) -> None:
    # A copy that is running when its session ends (the process died) must
    # finish before the handles close: closing under a running kernel is an
    # illegal address for the whole GPU context.
    engine = in_process_engine(tmp_path)
    held = HeldCopy()
    entered, release = held.entered, held.release

    class SlowDevice(SharedMemoryDevice):
        def gather(self, *args: Any, **kwargs: Any) -> None:
            held.hold()
            super().gather(*args, **kwargs)

    device = SlowDevice(engine.arena.address())
    ipc = IpcTransfers(engine, lambda gpu: device)
    try:
        ipc.register("s1", kv.registration())
        body = p.SaveBlocksRequest(keys=keys(1, "race"), block_ids=[[1, 2]], owner="o")
        saved: list[p.CommitStoreReply] = []
        saver = threading.Thread(target=lambda: saved.append(ipc.save("s1", body, "s1/o")))
        saver.start()
        assert entered.wait(10)
        # close() returns at once (the liveness thread must not wait on a copy)...
        assert ipc.close("s1")
        assert device.open_handles == 1  # ...and the running copy's memory stays mapped
        release.set()
        saver.join(10)
        assert not saver.is_alive() and device.open_handles == 0  # the copy's end closed it
        # Its session ended while it copied (the process died): what it copied may
        # be a dead forward pass's unfinished KV, so it is not stored.
        assert saved[0].committed == [False]
        assert engine.acquire(body.keys[0], "check") is None
        with pytest.raises(p.ProtocolError, match="REGISTER_KV first"):
            ipc.save("s1", body, "s1/o")  # no copy starts on a closed session
    finally:
        release.set()
        engine.close()


def test_a_session_ending_while_its_registration_opens_handles_leaves_nothing_mapped(
    tmp_path: Path, kv: SharedKV
) -> None:
    # The worker dies (its liveness socket closes) while its REGISTER_KV is
    # still opening handles: close() finds no mapping yet, so the registration
    # itself must close what it opened instead of inserting it.
    engine = in_process_engine(tmp_path)
    held = HeldCopy()

    class SlowOpen(SharedMemoryDevice):
        def open_memory(self, handle: bytes) -> int:
            address = super().open_memory(handle)
            held.hold()
            return address

    device = SlowOpen(engine.arena.address())
    ipc = IpcTransfers(engine, lambda gpu: device)
    try:
        outcome: list[object] = []

        def register() -> None:
            try:
                outcome.append(ipc.register("s1", kv.registration()))
            except p.ProtocolError as exc:
                outcome.append(exc)

        registrar = threading.Thread(target=register)
        registrar.start()
        assert held.entered.wait(10)  # a handle is open, the mapping not yet in the table
        assert ipc.close("s1")  # the session ends
        held.release.set()
        registrar.join(10)
        assert not registrar.is_alive()
        assert isinstance(outcome[0], p.ProtocolError), outcome
        assert "ended" in str(outcome[0])
        assert len(ipc) == 0 and device.open_handles == 0
        # A later session registers as usual: nothing of the race is left over.
        ipc.register("s2", kv.registration())
        assert ipc.close("s2") and device.open_handles == 0
    finally:
        held.release.set()
        engine.close()


def test_a_chunk_saved_in_ipc_mode_fits_a_host_mode_worker_of_the_same_layout(
    tmp_path: Path, kv: SharedKV
) -> None:
    # Two pods share a tier, one in ipc mode, one in host mode: a chunk the first
    # saved must carry the dtype and shape the second's loads check (slot_fits).
    from kvstrata.connector.arena_view import slot_fits
    from kvstrata.connector.client_arena import ArenaSlot
    from kvstrata.connector.layout import detect_layout

    engine = in_process_engine(tmp_path)
    device = SharedMemoryDevice(engine.arena.address())
    ipc = IpcTransfers(engine, lambda gpu: device)
    try:
        ipc.register("s1", kv.registration())
        body = p.SaveBlocksRequest(keys=keys(1, "shared-tier"), block_ids=[[1, 2]], owner="o")
        assert ipc.save("s1", body, "s1/o").committed == [True]
        ipc.close("s1")
        layout = detect_layout(
            kv.case.layers, kv_cache_layout=None, blocks_per_chunk=BLOCKS_PER_CHUNK, block_dim=0
        )
        slot = engine.acquire(body.keys[0], "host-worker")
        assert slot is not None
        seen = ArenaSlot(
            slot.lease_id, slot.offset, slot.length, slot.meta.dtype, tuple(slot.meta.shape)
        )
        assert seen.shape == layout.chunk_shape
        assert slot_fits(seen, layout)
        engine.release_lease(slot.lease_id)
    finally:
        engine.close()


def test_a_load_whose_leases_expired_during_its_copy_is_reported_as_not_loaded(
    tmp_path: Path, kv: SharedKV
) -> None:
    # The sidecar copies under read leases; a copy that outlasts them (a peer's
    # event waited on for long) may read slots already given to other chunks:
    # such a load must be reported as none, so vLLM recomputes those blocks.
    engine = in_process_engine(tmp_path)
    held = HeldCopy()
    entered, release = held.entered, held.release

    class StalledDevice(SharedMemoryDevice):
        """Double: a scatter that waits until the test has expired the leases."""

        def scatter(self, *args: Any, **kwargs: Any) -> None:
            held.hold()
            super().scatter(*args, **kwargs)

    device = StalledDevice(engine.arena.address())
    ipc = IpcTransfers(engine, lambda gpu: device)
    try:
        ipc.register("s1", kv.registration())
        ks = keys(1, "outlived")
        saved = ipc.save("s1", p.SaveBlocksRequest(keys=ks, block_ids=[[1, 2]], owner="o"), "s1/o")
        assert saved.committed == [True]
        body = p.LoadBlocksRequest(keys=ks, block_ids=[[5, 6]], owner="r")
        replies: list[p.LoadBlocksReply] = []
        loader = threading.Thread(target=lambda: replies.append(ipc.load("s1", body, "s1/r")))
        loader.start()
        assert entered.wait(10)
        assert engine.expire_leases(now=float("inf")) == 1  # the load's own lease
        release.set()
        loader.join(10)
        assert replies[0].loaded == 0
    finally:
        release.set()
        ipc.close("s1")
        engine.close()


def test_a_load_waits_for_the_event_vllm_recorded_before_it_fills_blocks(
    sidecar: ServedOnThread, kv: SharedKV
) -> None:
    # With asynchronous scheduling vLLM's previous step may still be queued and
    # use blocks this load fills: the scatter is ordered after vLLM's event.
    client = ipc_client(sidecar.endpoint)
    try:
        client.register_kv(kv.registration())
        ks = keys(1, "ordered-load")
        assert client.ipc.save_blocks(ks, [[3, 4]], None, "r1") == [True]
        event = b"\x42" * p.IPC_HANDLE_BYTES
        assert client.ipc.load_block_runs(ks, [[6, 7]], "r2", [1], after_event=event) == [1]
        assert sidecar.device.events_waited == [event]
    finally:
        client.close()


def test_a_steps_loads_promote_each_requests_chunks_only_from_its_load_tiers(
    sidecar: ServedOnThread, kv: SharedKV
) -> None:
    # Two requests of one step, each chunk saved and then pushed out of L1 into
    # L2: the one whose kv_transfer_params allow L1 only is a miss (vLLM
    # recomputes it), the other's chunk is promoted and loaded.
    from kvstrata.connector import ipc
    from kvstrata.connector.metadata import ChunkTransfer, RequestTransfer
    from kvstrata.sidecar.objformat import ChunkMeta

    client = ipc_client(sidecar.endpoint)
    try:
        client.register_kv(kv.registration())
        (only_l1,), (from_l2,) = keys(1, "tiers-l1"), keys(1, "tiers-l2")
        assert client.ipc.save_blocks([only_l1, from_l2], [[1, 2], [3, 4]], None, "s") == [
            True,
            True,
        ]
        engine = sidecar.engine
        assert engine.flush(30)
        slot = engine.acquire(only_l1, "size")
        assert slot is not None
        nbytes = slot.length
        engine.release(slot)
        meta = ChunkMeta(dtype="uint8", shape=(nbytes,))
        for key in keys((12 << 20) // nbytes, "flood"):  # 12 MiB through an 8 MiB L1
            assert engine.put(key, b"\x01" * nbytes, meta)
        assert engine.flush(30)
        assert engine.lookup([only_l1]).tiers == engine.lookup([from_l2]).tiers == ["l2"]
        fp = NAMESPACE.fingerprint()
        reqs = [
            RequestTransfer("r1", [ChunkTransfer(only_l1[len(fp):], [7, 8])],
                            load_tiers=frozenset({"l1"})),
            RequestTransfer("r2", [ChunkTransfer(from_l2[len(fp):], [9, 10])],
                            load_tiers=frozenset({"l1", "l2"})),
        ]  # fmt: skip
        event = b"\x42" * p.IPC_HANDLE_BYTES
        loaded = ipc.load_requests(client, lambda c: ChunkKey(fp + c.chunk_hash), reqs, event)
        assert loaded == [0, 1]
        assert engine.lookup([only_l1]).tiers == ["l2"]  # not promoted for r1
        for t in kv.case.layers.values():
            for src, dst in ((3, 9), (4, 10)):
                assert torch.equal(kv.block(t, dst), kv.block(t, src))
    finally:
        client.close()


def test_a_cuda_fault_moves_ipc_sessions_to_host_mode_keeps_the_sidecar_ready_and_is_exported(
    sidecar: ServedOnThread, kv: SharedKV
) -> None:
    from prometheus_client import generate_latest

    from kvstrata.sidecar.transfer.ipc_device import CudaDeviceError

    def illegal_address(*_args: Any, **_kwargs: Any) -> None:
        # The double's copy hits what a stray kernel access is on a GPU: a
        # sticky error, after which every CUDA call of the process fails.
        raise CudaDeviceError(
            "gather on device 0: an illegal memory access", "cudaErrorIllegalAddress"
        )

    client = ipc_client(sidecar.endpoint)
    try:
        client.register_kv(kv.registration())
        assert client.ipc.save_blocks(keys(1, "before"), [[1, 2]], None, "r") == [True]
        assert client.transfer_mode is TransferMode.IPC
        sidecar.device.gather = illegal_address  # type: ignore[method-assign]
        assert client.ipc.save_blocks(keys(1, "fault"), [[3, 4]], None, "r") == [False]
        # The pod stays in its Service: the sidecar is still ready ...
        assert sidecar.server.ready
        # ... and the worker's session ended: its next call says HELLO again and
        # is granted host mode, with the fault as the reason (a miss, not an error).
        assert client.ipc.load_blocks(keys(1, "before"), [[5, 6]], "r") is None
        assert client.transfer_mode is TransferMode.HOST
        assert "GPU context is broken" in client.ipc_fallback_reason
        assert len(sidecar.ipc) == 0  # nothing mapped for a session that ended
        # Host mode serves: the chunk saved before the fault is found.
        found = client.lookup(keys(1, "before"), prefetch=False, owner="r")
        assert found is not None and found.hit_chunks == 1
        # A new worker asking for ipc gets host mode and the reason.
        other = ipc_client(sidecar.endpoint)
        try:
            assert other.stats() is not None
            assert other.transfer_mode is TransferMode.HOST
        finally:
            other.close()
        # The fault is said where an operator looks: metrics and /status.
        text = generate_latest(sidecar.server.metrics.registry).decode()
        assert 'kvstrata_ipc_copy_failures_total{op="save"} 1.0' in text
        assert "kvstrata_ipc_gpu_faulted 1.0" in text
        status = sidecar.server.status()
        assert "illegal memory access" in status["gpu_fault"] and status["ready"]
        assert status["transfer_modes"] == ["host"]
    finally:
        client.close()


def test_a_copy_failure_that_leaves_the_gpu_usable_is_counted_and_keeps_the_sidecar_ready(
    sidecar: ServedOnThread, kv: SharedKV
) -> None:
    from prometheus_client import generate_latest

    from kvstrata.sidecar.transfer.ipc_device import CudaDeviceError

    def out_of_memory(*_args: Any, **_kwargs: Any) -> None:
        raise CudaDeviceError("scatter on device 0: out of memory", "cudaErrorMemoryAllocation")

    client = ipc_client(sidecar.endpoint)
    try:
        client.register_kv(kv.registration())
        ks = keys(1, "kept")
        assert client.ipc.save_blocks(ks, [[1, 2]], None, "r") == [True]
        sidecar.device.scatter = out_of_memory  # type: ignore[method-assign]
        assert client.ipc.load_blocks(ks, [[5, 6]], "r") == 0  # a miss, not an error
        assert sidecar.server.ready
        sidecar.device.fallbacks = 2  # what CudaDevice counts: staging calls run zero-copy
        text = generate_latest(sidecar.server.metrics.registry).decode()
        assert "kvstrata_ipc_staging_fallbacks_total 2.0" in text
        assert 'kvstrata_ipc_copy_failures_total{op="load"} 1.0' in text
        assert "kvstrata_ipc_gpu_faulted 0.0" in text
    finally:
        client.close()
