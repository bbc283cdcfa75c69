"""``kvstrata selftest gpu`` on a machine without CUDA, and its checks' logic on the CPU.

The command itself must say why it cannot run and exit 2. The checks are
code too: the kernel and copier checks run here on CPU tensors with the
host library (the same functions the GPU runs with the CUDA library), and
the expectations the ipc round trip's workers compute are checked against
copies made here, so a wrong selftest is caught before it meets a GPU.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import mmap
import multiprocessing
import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvstrata.sidecar.transfer import kernels
from kvstrata.testing import chunkref, gpuipc, selftest
from kvstrata.testing.gpuipc import CheckFailed
from kvstrata.testing.kvlayouts import vllm_layers
from kvstrata.testing.selftest import CheckResult


def selftest_cli(*extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvstrata", "selftest", "gpu", *extra],
        capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},  # no device, GPU node or not
    )  # fmt: skip


def test_selftest_gpu_without_a_cuda_device_exits_2_with_one_line_saying_why() -> None:
    done = selftest_cli()
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("no CUDA device: torch ")
    assert "csrc kernels: " in lines[0]


def test_selftest_gpu_json_without_a_cuda_device_prints_the_reason_in_one_object() -> None:
    done = selftest_cli("--json")
    assert done.returncode == 2
    record = json.loads(done.stdout)
    assert record["selftest"] == "gpu"
    assert record["ok"] is False
    assert record["skipped"].startswith("no CUDA device: ")


def test_the_kernel_check_passes_with_the_host_library_on_cpu_tensors() -> None:
    detail = selftest.check_kernels(kernels.load_host(), device="cpu")
    assert detail.startswith("66 layout x dtype x chunk-memory cases")  # 13 layouts x 5 + 1


class ScatterSkipsFirstChunk:
    """The host library, except that its scatter leaves the first chunk out."""

    def __init__(self) -> None:
        self.lib = kernels.load_host()

    def gather(self, *args: Any, **kwargs: Any) -> None:
        self.lib.gather(*args)

    def scatter(self, plan: Any, ids: Any, chunks: Any, per_chunk: int, **kw: Any) -> None:
        self.lib.scatter(plan, list(ids)[per_chunk:], list(chunks)[1:], per_chunk)

    def synchronize(self, stream: Any = 0) -> None:
        pass


def test_the_kernel_check_fails_naming_the_copies_when_a_scatter_is_wrong() -> None:
    with pytest.raises(CheckFailed, match=r"copies differ: scatter vllm-LBHNC"):
        selftest.check_kernels(ScatterSkipsFirstChunk(), device="cpu")


def test_the_torch_copier_check_passes_on_cpu_tensors() -> None:
    assert selftest.check_torch_copier(device="cpu").startswith("60 layout x dtype")


def test_a_check_that_crashes_is_a_failure_with_its_traceback() -> None:
    def crash() -> str:
        raise ZeroDivisionError("boom")

    result = selftest.run_check("crash", crash)
    assert isinstance(result, CheckResult)
    assert not result.ok
    assert "ZeroDivisionError: boom" in result.detail
    assert selftest.run_check("fine", lambda: "all good").ok


@pytest.mark.parametrize("layout,dtype", gpuipc.ROUND_TRIP_CASES)
def test_the_loading_worker_expects_the_stored_blocks_in_its_destination_blocks(
    layout: str, dtype: str
) -> None:
    # What the round trip does on the GPU, with the host library on CPU tensors.
    lib = kernels.load_host()
    src, dst = gpuipc._ids()
    source = gpuipc._build(layout, dtype, "cpu")
    case = vllm_layers(layout, dtype=getattr(torch, dtype), seed=99)
    for raw in chunkref.storage_bytes(list(case.layers.values())):
        raw.fill_(gpuipc.POISON_TARGET)
    plan = selftest._plan(list(source.layers.values()), 0)
    nbytes = plan.chunk_nbytes(gpuipc.BLOCKS_PER_CHUNK)
    arena = torch.full((nbytes * gpuipc.CHUNKS,), chunkref.POISON, dtype=torch.uint8)
    addresses = [arena.data_ptr() + c * nbytes for c in range(gpuipc.CHUNKS)]
    lib.gather(plan, src, addresses, gpuipc.BLOCKS_PER_CHUNK)
    kv = gpuipc.ExportedKV(layout, dtype, 0, "", b"", (), (), ())
    assert torch.equal(arena, torch.cat(gpuipc._reference_chunks(kv, src)))

    target_plan = selftest._plan(list(case.layers.values()), 0)
    lib.scatter(target_plan, dst, addresses, gpuipc.BLOCKS_PER_CHUNK)
    got = chunkref.storage_bytes(list(case.layers.values()))
    want = gpuipc._expected_target(layout, dtype, src, dst)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    # The expectation is not trivially met: other destination blocks disagree.
    shifted = gpuipc._expected_target(layout, dtype, src, dst[1:] + dst[:1])
    assert not all(torch.equal(g, w) for g, w in zip(got, shifted, strict=True))


def test_the_round_trip_registers_each_layer_at_its_offset_in_the_allocation() -> None:
    kv = gpuipc.ExportedKV(
        "LBNHC", "bfloat16", 2, "GPU-x", b"\x01" * 64, (0, 4096), ((12, 2, 16, 64),) * 2,
        ((2048, 64, 128, 1),) * 2,
    )  # fmt: skip
    body = gpuipc._registration(kv)
    assert [layer.offset for layer in body.layers or []] == [0, 4096]
    assert body.blocks_per_chunk == gpuipc.BLOCKS_PER_CHUNK
    assert len(set(gpuipc._keys(kv))) == gpuipc.CHUNKS
    other = gpuipc.ExportedKV("LBNHC", "float8_e4m3fn", 1, "", b"", (), (), ())
    assert not set(gpuipc._keys(kv)) & set(gpuipc._keys(other))


# -- the ipc round trip's sidecar side, with shared memory standing in for the GPU ------

SIM_GPU = "GPU-5e1f7e57-0000-4000-8000-000000000001"


class SharedMemoryCuda:
    """The CUDA library as the round trip's sidecar side uses it, over host memory:
    an IPC handle is the name of a /dev/shm segment (zero-padded to 64 bytes),
    copies run in the host library, events are recorded."""

    backend = "cuda"

    def __init__(self) -> None:
        self.host = kernels.load_host()
        self.maps: dict[str, tuple[mmap.mmap, Any]] = {}
        self.opens: dict[int, int] = {}
        self.events: list[bytes] = []
        self.registered: set[int] = set()

    def parse_uuid(self, text: str) -> bytes:
        return self.host.parse_uuid(text)

    def device_by_uuid(self, uuid: str) -> int:
        assert self.host.parse_uuid(uuid) == self.host.parse_uuid(SIM_GPU)
        return 0

    def set_device(self, device: int) -> None:
        assert device == 0

    def ipc_open(self, device: int, handle: bytes) -> int:
        name = handle.rstrip(b"\0").decode()
        if name not in self.maps:
            fd = os.open(f"/dev/shm/{name}", os.O_RDWR)
            try:
                mm = mmap.mmap(fd, os.fstat(fd).st_size)
            finally:
                os.close(fd)
            self.maps[name] = (mm, ctypes.c_char.from_buffer(mm))
        address = ctypes.addressof(self.maps[name][1])
        self.opens[address] = self.opens.get(address, 0) + 1
        return address

    def ipc_close(self, device: int, address: int) -> None:
        self.opens[address] -= 1

    def mem_range(self, device: int, address: int) -> tuple[int, int]:
        for mm, view in self.maps.values():
            if ctypes.addressof(view) == address:
                return address, len(mm)
        raise KeyError(address)

    def stream_create(self, device: int) -> int:
        return 1

    def stream_destroy(self, device: int, stream: int) -> None:
        pass

    def stream_wait_ipc_event(self, device: int, stream: int, handle: bytes) -> None:
        self.events.append(handle)

    def ipc_event_done(self, device: int, handle: bytes) -> bool:
        # Pending at the first query, as the worker's event is behind its GPU sleep.
        self.events.append(handle)
        return self.events.count(handle) > 1

    def host_register(self, address: int, nbytes: int) -> tuple[int, bool]:
        here = address not in self.registered
        self.registered.add(address)
        return address, here

    def host_unregister(self, address: int) -> None:
        self.registered.remove(address)

    def gather(self, plan: Any, ids: Any, chunks: Any, per_chunk: int, **kw: Any) -> None:
        self.host.gather(plan, ids, chunks, per_chunk)

    def scatter(self, plan: Any, ids: Any, chunks: Any, per_chunk: int, **kw: Any) -> None:
        self.host.scatter(plan, ids, chunks, per_chunk)

    def synchronize(self, stream: Any = 0) -> None:
        pass

    def close(self) -> None:
        for mm, view in self.maps.values():
            del view
            with contextlib.suppress(BufferError):
                mm.close()


@contextlib.contextmanager
def shm_worker(
    role: str, cases: Any = (), nbytes: int = 0, shape: dict[str, int] | None = None
) -> Iterator[tuple[None, Any]]:
    """Stands in for gpuipc._worker: the KV of every case in a /dev/shm segment, as the
    real worker builds it (same seed), and a thread answering the pipe like it."""
    parent, child = multiprocessing.Pipe()
    segments: list[tuple[str, mmap.mmap, Any, str, str]] = []
    payload = []
    for layout, dtype in cases:
        case = gpuipc._build(layout, dtype, "cpu", shape)
        (storage,) = chunkref.storage_bytes(list(case.layers.values()))
        name = f"kvstrata-test-selftest-{uuid.uuid4().hex[:12]}"
        fd = os.open(f"/dev/shm/{name}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, storage.numel())
            mm = mmap.mmap(fd, storage.numel())
        finally:
            os.close(fd)
        raw = torch.frombuffer(mm, dtype=torch.uint8)
        raw.copy_(gpuipc.POISON_TARGET if role == "target" else storage)
        segments.append((name, mm, raw, layout, dtype))
        layers = list(case.layers.values())
        itemsize = layers[0].element_size()
        payload.append(
            gpuipc.ExportedKV(
                layout, dtype, itemsize, SIM_GPU, name.encode().ljust(64, b"\0"),
                tuple(t.storage_offset() * itemsize for t in layers),
                tuple(tuple(t.shape) for t in layers), tuple(tuple(t.stride()) for t in layers),
            )
        )  # fmt: skip
    event = b"\x0e" * 64 if role in ("source", "export") else None

    def serve() -> None:
        child.send(("ready", (payload, event)))
        while True:
            message = child.recv()
            if message[0] == "exit":
                return
            _, src, dst = message
            problems = [
                f"{layout}/{dtype}"
                for _, _, raw, layout, dtype in segments
                if not torch.equal(raw, gpuipc._expected_target(layout, dtype, src, dst)[0])
            ]
            child.send(("checked", "; ".join(problems)))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield None, parent
    finally:
        parent.send(("exit",))
        thread.join(10)
        for name, mm, raw, _, _ in segments:
            del raw
            with contextlib.suppress(BufferError):
                mm.close()
            os.unlink(f"/dev/shm/{name}")


def test_the_round_trip_stores_and_loads_every_case_through_the_sidecar_code(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(gpuipc, "_worker", shm_worker)
    lib = SharedMemoryCuda()
    try:
        detail = gpuipc.check_ipc_round_trip(lib, ("zero_copy",))  # the double has no device memory
    finally:
        lib.close()
    assert detail.startswith(f"{len(gpuipc.ROUND_TRIP_CASES)} layouts x dtypes stored")
    assert "an unpinned arena registered by CudaDevice gathers the same bytes" in detail
    # Every save asked for the event; the first found it pending and asked again.
    assert len(lib.events) == len(gpuipc.ROUND_TRIP_CASES) + 2
    assert all(n == 0 for n in lib.opens.values())  # every handle was closed
    assert not lib.registered


def test_the_round_trip_fails_when_a_load_writes_the_wrong_blocks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(gpuipc, "_worker", shm_worker)
    lib = SharedMemoryCuda()
    real_scatter = lib.scatter

    def off_by_one(plan: Any, ids: Any, chunks: Any, per_chunk: int, **kw: Any) -> None:
        real_scatter(plan, [(b + 1) % 12 if b >= 0 else b for b in ids], chunks, per_chunk)

    lib.scatter = off_by_one  # type: ignore[method-assign]
    try:
        with pytest.raises(CheckFailed, match="the loading worker's KV is wrong: LBHNC"):
            gpuipc.check_ipc_round_trip(lib, ("zero_copy",))  # the double has no device memory
    finally:
        lib.close()


def test_the_transfer_benchmark_times_the_ipc_path_through_cuda_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvstrata.bench import transfer

    monkeypatch.setattr(gpuipc, "_worker", shm_worker)
    lib = SharedMemoryCuda()
    per_chunk = transfer.CHUNK_TOKENS // transfer.BLOCK
    layout = transfer._case("BLNHC", 2 * per_chunk, "cpu")
    try:
        row = transfer._measure_ipc(
            lib, "BLNHC", 2 * per_chunk, list(range(per_chunk)), layout.chunk_nbytes, 1, 1
        )
    finally:
        lib.close()
    assert row["store_gbps"] > 0 and row["load_gbps"] > 0
    # Warm-up and timed store both asked for the event (the double's first answer: pending).
    assert lib.events == [b"\x0e" * 64] * 3
    assert all(n == 0 for n in lib.opens.values())
    assert not lib.registered
