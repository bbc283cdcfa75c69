"""CudaDevice (the sidecar's GPU in ipc mode) without a GPU, and GPU UUID parsing.

The CUDA library is replaced by :class:`RecordingCuda`, a stand-in that
records every runtime call (device, stream, order) and runs the copies with
the host build of the csrc kernels, and "device memory" (the staging buffer)
with host tensors and memmove, so the bytes a CudaDevice moves are real and
the order of its calls (event wait, copy, synchronise) is checked. UUID
parsing runs in the real libraries. What only a GPU shows (CUDA IPC,
events, pinned mappings) is in tests/gpu/test_selftest_gpu.py.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstrata.sidecar import protocol as p
from kvstrata.sidecar.arena import Arena
from kvstrata.sidecar.config import ConfigError, config_from_dict
from kvstrata.sidecar.engine import StorageManager
from kvstrata.sidecar.keys import ChunkKey, Namespace
from kvstrata.sidecar.transfer import csrc_build, kernels
from kvstrata.sidecar.transfer.cuda_device import CudaDevice, CudaDevices
from kvstrata.sidecar.transfer.ipc import IpcTransfers
from kvstrata.sidecar.transfer.ipc_device import CudaDeviceError
from kvstrata.sidecar.transfer.kernel_binding import KernelError, TransferLibrary
from kvstrata.sidecar.transfer.plan import CopyPlan, TensorGeometry, plan_from_geometry
from kvstrata.testing import chunkref
from kvstrata.testing.kvlayouts import vllm_layers

GPU0 = "GPU-0a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9"
GPU1 = "GPU-11111111-2222-3333-4444-555555555555"
ARENA_DELTA = 1 << 44  # the stand-in maps the arena at host address + this for "kernels"
DEVICE_DELTA = 1 << 45  # and "device memory" at the host address of a tensor + this
GARBAGE = 0x5C  # what fresh "device memory" holds


class RecordingCuda:
    """A stand-in for the CUDA library (see the module docstring).

    ``devices``: UUID -> index. IPC handles name CPU tensors the test hands
    in (``exports``); the arena's "device address" is its host address plus
    :data:`ARENA_DELTA`, so a copy given a host address instead fails.
    """

    backend = "cuda"

    def __init__(self, devices: dict[str, int], pinned_already: bool = False) -> None:
        self.host = kernels.load_host()
        self.devices = {self.host.parse_uuid(u): i for u, i in devices.items()}
        self.calls: list[tuple[Any, ...]] = []
        self.current = 0
        self.registered: set[int] = set()
        self.pinned_already = pinned_already
        self.exports: dict[bytes, torch.Tensor] = {}
        self.open: dict[int, int] = {}
        self.arena_range = (0, 0)
        self.allocations: dict[int, torch.Tensor] = {}  # device address -> host tensor

    def _fail(self, fn: str, name: str) -> KernelError:
        return KernelError(fn, 1, name, "stand-in failure")

    def parse_uuid(self, text: str) -> bytes:
        return self.host.parse_uuid(text)

    def device_by_uuid(self, uuid: str) -> int:
        key = self.host.parse_uuid(uuid)
        if key not in self.devices:
            raise self._fail("kvs_cuda_device_by_uuid", "cudaErrorInvalidDevice")
        return self.devices[key]

    def set_device(self, device: int) -> None:
        self.calls.append(("set_device", device))
        self.current = device

    def ipc_open(self, device: int, handle: bytes) -> int:
        self.calls.append(("ipc_open", device))
        if handle not in self.exports:
            raise self._fail("kvs_cuda_ipc_open", "cudaErrorInvalidResourceHandle")
        address = self.exports[handle].data_ptr()
        self.open[address] = self.open.get(address, 0) + 1
        return address

    def ipc_close(self, device: int, address: int) -> None:
        self.calls.append(("ipc_close", device))
        self.open[address] -= 1

    def mem_range(self, device: int, address: int) -> tuple[int, int]:
        for t in self.exports.values():
            start = t.data_ptr()
            if start <= address < start + t.numel() * t.element_size():
                return start, t.numel() * t.element_size()
        raise self._fail("kvs_cuda_mem_range", "cudaErrorInvalidValue")

    def stream_create(self, device: int) -> int:
        self.calls.append(("stream_create", device))
        return 0x5000 + device

    def stream_destroy(self, device: int, stream: int) -> None:
        self.calls.append(("stream_destroy", device, stream))

    def stream_wait_ipc_event(self, device: int, stream: int, handle: bytes) -> None:
        self.calls.append(("wait_event", device, stream, handle))

    event_done = True  # a peer that never finishes (killed) sets False
    event_queried: Any = None  # a threading.Event set at the first query, when given

    def ipc_event_done(self, device: int, handle: bytes) -> bool:
        if not self.calls or self.calls[-1][:2] != ("event_query", device):
            self.calls.append(("event_query", device, handle))
        if self.event_queried is not None:
            self.event_queried.set()
        return self.event_done

    def host_register(self, address: int, nbytes: int) -> tuple[int, bool]:
        self.calls.append(("host_register", self.current))
        here = not self.pinned_already and address not in self.registered
        if here:
            self.registered.add(address)
        self.arena_range = (address + ARENA_DELTA, address + ARENA_DELTA + nbytes)
        return address + ARENA_DELTA, here

    def host_unregister(self, address: int) -> None:
        self.calls.append(("host_unregister",))
        self.registered.remove(address)

    def malloc(self, device: int, nbytes: int) -> int:
        self.calls.append(("malloc", device, nbytes))
        memory = torch.full((nbytes,), GARBAGE, dtype=torch.uint8)
        address = memory.data_ptr() + DEVICE_DELTA
        self.allocations[address] = memory
        return address

    def free(self, device: int, address: int) -> None:
        self.calls.append(("free", device, address))
        del self.allocations[address]

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self.calls.append(("memcpy", self.where(dst), self.where(src), nbytes, stream))
        ctypes.memmove(self._host(dst, nbytes), self._host(src, nbytes), nbytes)

    def where(self, address: int) -> str:
        """``arena`` or ``device`` (a staging buffer) for a device address."""
        return "arena" if self.arena_range[0] <= address < self.arena_range[1] else "device"

    def _host(self, address: int, nbytes: int) -> int:
        """The host address behind ``nbytes`` at a device address (arena or allocation)."""
        low, high = self.arena_range
        if low <= address and address + nbytes <= high:
            return address - ARENA_DELTA
        for base, memory in self.allocations.items():
            if base <= address and address + nbytes <= base + memory.numel():
                return address - DEVICE_DELTA
        raise AssertionError(f"{nbytes} bytes at {address:#x} are no device memory of this GPU")

    def _to_host(self, addresses: list[int], nbytes: int) -> list[int]:
        return [self._host(a, nbytes) for a in addresses]

    def gather(self, plan: CopyPlan, ids: Any, chunks: Any, per_chunk: int, **kw: Any) -> None:
        chunks = list(chunks)
        self.calls.append(("gather", self.current, kw["stream"], [self.where(c) for c in chunks]))
        self.host.gather(plan, ids, self._to_host(chunks, plan.chunk_nbytes(per_chunk)), per_chunk)

    def scatter(self, plan: CopyPlan, ids: Any, chunks: Any, per_chunk: int, **kw: Any) -> None:
        chunks = list(chunks)
        self.calls.append(("scatter", self.current, kw["stream"], [self.where(c) for c in chunks]))
        host = self._to_host(chunks, plan.chunk_nbytes(per_chunk))
        self.host.scatter(plan, ids, host, per_chunk)

    def synchronize(self, stream: int) -> None:
        self.calls.append(("synchronize", stream))


@pytest.fixture
def arena() -> Iterator[Arena]:
    a = Arena(1 << 20)
    yield a
    a.close()


def names(calls: list[tuple[Any, ...]]) -> list[str]:
    return [c[0] for c in calls]


# -- UUIDs ----------------------------------------------------------------------

UUID_BYTES = bytes.fromhex("0a1b2c3d4e5f60718293a4b5c6d7e8f9")
SAME_GPU = [
    "GPU-0a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9",  # nvidia-smi -L, NVIDIA_VISIBLE_DEVICES
    "0a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9",  # str(torch.cuda.get_device_properties(i).uuid)
    "gpu-0A1B2C3D-4E5F-6071-8293-A4B5C6D7E8F9",
    "MIG-0a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9",
    "0a1b2c3d4e5f60718293a4b5c6d7e8f9",
]
NOT_UUIDS = [
    "",
    "GPU-",
    "GPU-ffffffff",
    "GPU-0a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f",  # 31 digits
    "GPU-0a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f90",  # 33
    "GPU-0a1b2c3d-4e5f-6071-8293-a4b5c6d7e8fg",
    "GPU--0a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9",
    "GPU-0a1b2c3d--4e5f-6071-8293-a4b5c6d7e8f9",
    "GPU-0a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9-",
    "CPU-0a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9",
    " 0a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9",
    "MIG-GPU-0a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9/1/0",
]


@pytest.mark.parametrize("text", SAME_GPU)
def test_every_form_nvidia_smi_torch_and_mig_write_names_the_same_uuid(text: str) -> None:
    assert kernels.load_host().parse_uuid(text) == UUID_BYTES


@pytest.mark.parametrize("text", NOT_UUIDS)
def test_text_that_is_not_a_uuid_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="is not a GPU UUID"):
        kernels.load_host().parse_uuid(text)


@pytest.mark.skipif(csrc_build.find_nvcc() is None, reason="nvcc not found (no CUDA toolkit)")
def test_the_cuda_library_parses_uuids_as_the_host_library_does() -> None:
    cuda = kernels._load(csrc_build.CUDA)
    for text in SAME_GPU:
        assert cuda.parse_uuid(text) == UUID_BYTES
    for text in NOT_UUIDS:
        with pytest.raises(ValueError):
            cuda.parse_uuid(text)


# -- CudaDevice -------------------------------------------------------------------


def test_a_device_is_opened_by_uuid_with_its_own_stream_and_the_arena_mapped_for_it(
    arena: Arena,
) -> None:
    lib = RecordingCuda({GPU0: 0, GPU1: 1})
    device = CudaDevice(lib, GPU1.lower().removeprefix("gpu-"), arena)  # type: ignore[arg-type]
    assert device.index == 1
    assert device.stream == 0x5001
    assert ("host_register", 1) in lib.calls  # registered while device 1 was current
    assert device.arena_address(0) == arena.address() + ARENA_DELTA
    assert device.arena_address(arena.size - 1) == arena.address() + ARENA_DELTA + arena.size - 1
    with pytest.raises(ValueError, match="outside"):
        device.arena_address(arena.size)
    device.close()
    assert lib.registered == set()  # it registered the arena, so it unregistered it


def test_a_gpu_that_is_not_visible_or_not_a_uuid_is_an_os_error_naming_it(arena: Arena) -> None:
    lib = RecordingCuda({GPU0: 0})
    with pytest.raises(CudaDeviceError, match=f"GPU {GPU1} is not visible") as info:
        CudaDevice(lib, GPU1, arena)  # type: ignore[arg-type]
    assert isinstance(info.value, OSError)
    assert info.value.name == "cudaErrorInvalidDevice"
    with pytest.raises(OSError, match="is not a GPU UUID"):
        CudaDevice(lib, "GPU-ffffffff", arena)  # type: ignore[arg-type]
    assert lib.registered == set()


def test_an_arena_torch_already_pinned_is_used_and_never_unregistered(arena: Arena) -> None:
    lib = RecordingCuda({GPU0: 0}, pinned_already=True)
    devices = CudaDevices(lib, arena)  # type: ignore[arg-type]
    device = devices(GPU0)
    assert device.arena_address(8) == arena.address() + ARENA_DELTA + 8
    devices.close()
    assert "host_unregister" not in names(lib.calls)


def test_devices_of_one_factory_share_one_arena_registration_released_at_close(
    arena: Arena,
) -> None:
    lib = RecordingCuda({GPU0: 0, GPU1: 1})
    devices = CudaDevices(lib, arena)  # type: ignore[arg-type]
    first, second = devices(GPU0), devices(GPU1)
    assert (first.index, second.index) == (0, 1)
    first.close()  # a device of the factory leaves the shared registration alone
    assert lib.registered == {arena.address()}
    devices.close()
    assert lib.registered == set()
    assert names(lib.calls).count("stream_destroy") == 2


def test_gather_waits_for_the_peer_event_on_its_stream_before_copying_and_syncs_after(
    arena: Arena,
) -> None:
    lib = RecordingCuda({GPU0: 0, GPU1: 1})
    device = CudaDevice(lib, GPU1, arena)  # type: ignore[arg-type]
    case = vllm_layers("LBNHC", seed=1)
    plan = plan_from_geometry([TensorGeometry.of(t) for t in case.layers.values()], 0).coalesced()
    event = b"\x42" * 64
    lib.calls.clear()
    lib.current = 0  # another thread's work left device 0 current

    device.gather(plan, [3, 7], [device.arena_address(64)], 2, event)

    assert lib.calls == [
        ("event_query", 1, event),  # completed before the copy is queued
        ("set_device", 1),
        ("gather", 1, device.stream, ["arena"]),
        ("synchronize", device.stream),
    ]
    got = torch.frombuffer(arena.buffer, dtype=torch.uint8)[64 : 64 + plan.chunk_nbytes(2)]
    assert torch.equal(got, chunkref.chunk_bytes(case, [3, 7], 0))


def test_scatter_waits_for_vllms_event_on_the_host_before_filling_blocks(arena: Arena) -> None:
    lib = RecordingCuda({GPU0: 0})
    device = CudaDevice(lib, GPU0, arena)  # type: ignore[arg-type]
    case = vllm_layers("LBNHC", seed=4)
    plan = plan_from_geometry([TensorGeometry.of(t) for t in case.layers.values()], 0).coalesced()
    event = b"\x17" * 64
    lib.calls.clear()

    device.scatter(plan, [5, 6], [device.arena_address(0)], 2, event)

    # No device-side wait: a killed vLLM's event could hold the stream sync forever.
    assert [c[0] for c in lib.calls] == ["event_query", "set_device", "scatter", "synchronize"]
    assert lib.calls[0] == ("event_query", 0, event)


def test_gather_without_an_event_and_scatter_copy_on_the_device_stream_and_sync(
    arena: Arena,
) -> None:
    lib = RecordingCuda({GPU0: 0})
    device = CudaDevice(lib, GPU0, arena)  # type: ignore[arg-type]
    case = vllm_layers("BLNHC", seed=2)
    layers = list(case.layers.values())
    plan = plan_from_geometry([TensorGeometry.of(t) for t in layers], 0).coalesced()
    before = chunkref.clone_layers(layers)
    lib.calls.clear()

    device.gather(plan, [1, 2], [device.arena_address(0)], 2, None)
    device.scatter(plan, [9, -1], [device.arena_address(0)], 2)

    assert names(lib.calls) == [
        "set_device", "gather", "synchronize", "set_device", "scatter", "synchronize",
    ]  # fmt: skip
    for layer, old in zip(layers, before, strict=True):
        assert torch.equal(chunkref.page_bytes(case, layer, 9), chunkref.page_bytes(case, old, 1))
        assert torch.equal(chunkref.page_bytes(case, layer, 2), chunkref.page_bytes(case, old, 2))


def test_a_failed_copy_is_an_os_error_naming_the_cuda_error(arena: Arena) -> None:
    lib = RecordingCuda({GPU0: 0})
    device = CudaDevice(lib, GPU0, arena)  # type: ignore[arg-type]

    def fault(stream: int) -> None:
        raise KernelError("cudaStreamSynchronize", 700, "cudaErrorIllegalAddress", "fault")

    lib.synchronize = fault  # type: ignore[method-assign]
    case = vllm_layers("LBNHC", seed=3)
    plan = plan_from_geometry([TensorGeometry.of(t) for t in case.layers.values()], 0)
    with pytest.raises(CudaDeviceError, match="cudaErrorIllegalAddress"):
        device.gather(plan, [0], [device.arena_address(0)], 1, None)


def test_a_handle_opened_twice_must_be_closed_twice_and_close_releases_what_is_left(
    arena: Arena,
) -> None:
    lib = RecordingCuda({GPU0: 0})
    kv = torch.zeros(4096, dtype=torch.uint8)
    handle = b"\x01" * 64
    lib.exports[handle] = kv
    device = CudaDevice(lib, GPU0, arena)  # type: ignore[arg-type]

    assert device.open_memory(handle) == device.open_memory(handle) == kv.data_ptr()
    assert device.open_handles == 2
    device.close_memory(kv.data_ptr())
    assert device.open_handles == 1
    with pytest.raises(OSError, match="cudaErrorInvalidResourceHandle"):
        device.open_memory(b"\x02" * 64)

    device.close()
    assert lib.open[kv.data_ptr()] == 0  # the handle left open was closed
    assert device.open_handles == 0
    with pytest.raises(KeyError):
        device.close_memory(kv.data_ptr())
    with pytest.raises(OSError, match="is closed"):
        device.open_memory(handle)
    device.close()  # a second close does nothing
    assert names(lib.calls).count("stream_destroy") == 1


# -- the staging copy path ----------------------------------------------------------

CHUNK_2 = 49152  # plan.chunk_nbytes(2) of vllm_layers' default shape
TWO_CHUNKS = 2 * CHUNK_2 + 1000  # a staging buffer that holds two such chunks, not three


def staging_pair(
    lib: RecordingCuda, arena: Arena, staging_bytes: int = TWO_CHUNKS
) -> tuple[CudaDevice, CudaDevice]:
    """A zero-copy device and a staging device (another GPU) over one arena registration."""
    zero = CudaDevice(lib, GPU0, arena)  # type: ignore[arg-type]
    staged = CudaDevice(
        lib, GPU1, arena, zero.registration, copy_path="staging",  # type: ignore[arg-type]
        staging_bytes=staging_bytes,
    )  # fmt: skip
    return zero, staged


def arena_bytes(arena: Arena, offset: int, nbytes: int) -> torch.Tensor:
    return torch.frombuffer(arena.buffer, dtype=torch.uint8)[offset : offset + nbytes].clone()


def plan_of(layout: str, seed: int) -> tuple[Any, CopyPlan]:
    case = vllm_layers(layout, seed=seed)
    plan = plan_from_geometry([TensorGeometry.of(t) for t in case.layers.values()], 0).coalesced()
    assert plan.chunk_nbytes(2) == CHUNK_2
    return case, plan


@pytest.mark.parametrize("layout", ["LBNHC", "BLNHC"])
def test_a_staged_gather_larger_than_the_buffer_runs_in_batches_and_matches_zero_copy(
    arena: Arena, layout: str
) -> None:
    lib = RecordingCuda({GPU0: 0, GPU1: 1})
    zero, staged = staging_pair(lib, arena)
    case, plan = plan_of(layout, seed=5)
    # Five chunks, one with a skipped position: its arena bytes must come through unchanged.
    ids = [3, 7, 0, 11, -1, 5, 2, 2, 9, 1]
    region = 5 * CHUNK_2
    torch.frombuffer(arena.buffer, dtype=torch.uint8)[: 2 * region] = chunkref.POISON
    lib.calls.clear()

    zero.gather(plan, ids, [zero.arena_address(i * CHUNK_2) for i in range(5)], 2, None)
    staged.gather(
        plan, ids, [staged.arena_address(region + i * CHUNK_2) for i in range(5)], 2, None
    )

    assert torch.equal(arena_bytes(arena, region, region), arena_bytes(arena, 0, region))
    assert torch.equal(
        arena_bytes(arena, region + 2 * CHUNK_2, CHUNK_2),
        chunkref.chunk_bytes(case, [-1, 5], chunkref.POISON),
    )
    staged_calls = lib.calls[names(lib.calls).index("malloc") :]
    kernels_run = [c for c in staged_calls if c[0] == "gather"]
    assert [len(c[3]) for c in kernels_run] == [2, 2, 1]  # 5 chunks, 2 per batch
    assert all(c[3] == ["device"] * len(c[3]) for c in kernels_run)
    back = [c for c in staged_calls if c[0] == "memcpy" and c[1:3] == ("arena", "device")]
    fetched = [c for c in staged_calls if c[0] == "memcpy" and c[1:3] == ("device", "arena")]
    assert len(back) == 5 and all(c[3] == CHUNK_2 for c in back)
    assert len(fetched) == 1  # only the chunk with a skipped position
    assert names(staged_calls).count("synchronize") == 1
    assert names(staged_calls)[-1] == "synchronize"


@pytest.mark.parametrize("layout", ["LBNHC", "BLNHC"])
def test_a_staged_scatter_larger_than_the_buffer_writes_the_same_kv_as_zero_copy(
    arena: Arena, layout: str
) -> None:
    lib = RecordingCuda({GPU0: 0, GPU1: 1})
    zero, staged = staging_pair(lib, arena)
    case_zero, plan_zero = plan_of(layout, seed=6)
    case_staged, plan_staged = plan_of(layout, seed=6)
    chunks = torch.randint(0, 256, (5 * CHUNK_2,), dtype=torch.uint8, generator=torch.Generator())
    torch.frombuffer(arena.buffer, dtype=torch.uint8)[: chunks.numel()] = chunks
    ids = [4, -1, 8, 10, 0, 1, -1, 6, 3, 2]
    addresses = [staged.arena_address(i * CHUNK_2) for i in range(5)]
    lib.calls.clear()

    zero.scatter(plan_zero, ids, addresses, 2)
    staged.scatter(plan_staged, ids, addresses, 2)

    written_zero = chunkref.storage_bytes(list(case_zero.layers.values()))
    written_staged = chunkref.storage_bytes(list(case_staged.layers.values()))
    for a, b in zip(written_zero, written_staged, strict=True):  # bytes: random bf16 has NaNs
        assert torch.equal(a, b)
    for c, pair in ((1, [8, 10]), (2, [0, 1]), (4, [3, 2])):  # the chunks with no skip
        written = chunkref.chunk_bytes(case_staged, pair, 0)
        assert torch.equal(written, chunks[c * CHUNK_2 : (c + 1) * CHUNK_2])
    staged_calls = lib.calls[names(lib.calls).index("malloc") :]
    fetched = [c for c in staged_calls if c[0] == "memcpy"]
    assert [c[1:3] for c in fetched] == [("device", "arena")] * 5
    kernels_run = [c for c in staged_calls if c[0] == "scatter"]
    assert [len(c[3]) for c in kernels_run] == [2, 2, 1]
    assert names(staged_calls)[-1] == "synchronize"


def test_a_staged_gather_waits_for_the_peer_event_before_its_first_copy(arena: Arena) -> None:
    lib = RecordingCuda({GPU0: 0, GPU1: 1})
    _, staged = staging_pair(lib, arena)
    _, plan = plan_of("LBNHC", seed=7)
    event = b"\x33" * 64
    lib.calls.clear()

    staged.gather(plan, [1, 2, 3, 4, 5, 6], [staged.arena_address(0)] * 3, 2, event)

    order = names(lib.calls)
    assert order[:2] == ["event_query", "set_device"]  # completed before anything is queued
    assert order.index("event_query") < order.index("gather") < order.index("memcpy")
    assert order[-1] == "synchronize"
    assert all(c[1] == 1 for c in lib.calls if c[0] == "gather")  # on the staging device


def test_the_staging_buffer_is_allocated_once_at_the_first_copy_and_freed_at_close(
    arena: Arena,
) -> None:
    lib = RecordingCuda({GPU0: 0, GPU1: 1})
    zero, staged = staging_pair(lib, arena)
    _, plan = plan_of("LBNHC", seed=8)
    assert "malloc" not in names(lib.calls)  # nothing allocated for a device that never copies

    staged.gather(plan, [1, 2], [staged.arena_address(0)], 2, None)
    staged.scatter(plan, [3, 4], [staged.arena_address(0)], 2)
    zero.gather(plan, [1, 2], [zero.arena_address(0)], 2, None)

    assert [c for c in lib.calls if c[0] == "malloc"] == [("malloc", 1, TWO_CHUNKS)]
    address = next(iter(lib.allocations))
    lib.calls.clear()
    staged.close()
    zero.close()
    assert lib.allocations == {}
    order = names(lib.calls)
    assert order.count("free") == 1 and ("free", 1, address) in lib.calls
    assert order.index("synchronize") < order.index("free") < order.index("stream_destroy")


def test_a_chunk_larger_than_the_staging_buffer_is_copied_zero_copy_and_counted(
    arena: Arena, caplog: pytest.LogCaptureFixture
) -> None:
    lib = RecordingCuda({GPU0: 0, GPU1: 1})
    _, staged = staging_pair(lib, arena, staging_bytes=CHUNK_2 - 1)
    case, plan = plan_of("LBNHC", seed=9)
    lib.calls.clear()

    staged.gather(plan, [5, 6], [staged.arena_address(0)], 2, None)
    staged.gather(plan, [7, 8], [staged.arena_address(CHUNK_2)], 2, None)

    assert "malloc" not in names(lib.calls) and "memcpy" not in names(lib.calls)
    assert [c[3] for c in lib.calls if c[0] == "gather"] == [["arena"], ["arena"]]
    assert staged.fallbacks == 2
    assert caplog.text.count("exceeds ipc.staging_bytes") == 1  # warned once per device
    assert torch.equal(arena_bytes(arena, 0, CHUNK_2), chunkref.chunk_bytes(case, [5, 6], 0))


def test_a_staged_copy_with_mismatched_block_ids_is_refused_before_anything_runs(
    arena: Arena,
) -> None:
    lib = RecordingCuda({GPU0: 0, GPU1: 1})
    _, staged = staging_pair(lib, arena)
    _, plan = plan_of("LBNHC", seed=10)
    lib.calls.clear()
    with pytest.raises(ValueError, match="3 block ids for 2 chunks of 2 blocks"):
        staged.scatter(plan, [1, 2, 3], [staged.arena_address(0)] * 2, 2)
    assert not {"gather", "scatter", "memcpy"} & set(names(lib.calls))


def test_a_staging_buffer_the_gpu_cannot_allocate_is_an_os_error_naming_the_setting(
    arena: Arena,
) -> None:
    lib = RecordingCuda({GPU0: 0, GPU1: 1})
    _, staged = staging_pair(lib, arena)
    _, plan = plan_of("LBNHC", seed=11)

    def full(device: int, nbytes: int) -> int:
        raise KernelError("kvs_cuda_malloc", 2, "cudaErrorMemoryAllocation", "out of memory")

    lib.malloc = full  # type: ignore[method-assign]
    with pytest.raises(CudaDeviceError, match=r"ipc\.staging_bytes.*cudaErrorMemoryAllocation"):
        staged.gather(plan, [1, 2], [staged.arena_address(0)], 2, None)


@pytest.mark.parametrize(
    ("copy_path", "staging_bytes", "refused"),
    [("dma", 1 << 20, "copy_path"), ("staging", 0, "staging_bytes")],
)
def test_a_device_refuses_an_unknown_copy_path_or_an_empty_staging_buffer(
    arena: Arena, copy_path: str, staging_bytes: int, refused: str
) -> None:
    lib = RecordingCuda({GPU0: 0})
    with pytest.raises(ValueError, match=refused):
        CudaDevice(
            lib, GPU0, arena, copy_path=copy_path, staging_bytes=staging_bytes,  # type: ignore[arg-type]
        )  # fmt: skip
    with pytest.raises(ValueError, match=refused):
        CudaDevices(lib, arena, 0, copy_path, staging_bytes)  # type: ignore[arg-type]
    assert lib.registered == set()


def test_the_factory_gives_every_device_its_copy_path(arena: Arena) -> None:
    lib = RecordingCuda({GPU0: 0, GPU1: 1})
    devices = CudaDevices(lib, arena, copy_path="staging", staging_bytes=4 << 20)  # type: ignore[arg-type]
    try:
        for device in (devices(GPU0), devices(GPU1)):
            assert (device.copy_path, device.staging_bytes) == ("staging", 4 << 20)
    finally:
        devices.close()


# -- the copy path in the sidecar's config ------------------------------------------


def test_the_ipc_copy_path_defaults_to_zero_copy_with_a_256mi_staging_buffer() -> None:
    config = config_from_dict({})
    assert config.ipc.copy_path == "zero_copy"
    assert config.ipc.staging_bytes == 256 << 20
    assert config_from_dict({"ipc": {"copy_path": "staging", "staging_bytes": "64Mi"}}).ipc == (
        type(config.ipc)(copy_path="staging", staging_bytes=64 << 20)
    )


@pytest.mark.parametrize(
    ("section", "field"),
    [
        ({"copy_path": "dma"}, "ipc.copy_path"),
        ({"staging_bytes": "512k"}, "ipc.staging_bytes"),
        ({"staging_bytes": "lots"}, "ipc.staging_bytes"),
        ({"stage_bytes": "1Mi"}, "ipc.stage_bytes"),
    ],
)
def test_a_bad_ipc_section_is_refused_naming_the_field(section: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        config_from_dict({"ipc": section})


# -- through IpcTransfers, the sidecar's ipc ops ------------------------------------

NAMESPACE = Namespace(model="cuda-device-test", block_size=16, chunk_size=32)


def chunk_keys(n: int, tag: str) -> list[ChunkKey]:
    fp = NAMESPACE.fingerprint()
    return [ChunkKey(fp + hashlib.sha256(f"{tag}/{i}".encode()).digest()) for i in range(n)]


def test_the_sidecar_ipc_ops_save_and_load_blocks_through_a_cuda_device(tmp_path: Path) -> None:
    config = config_from_dict(
        {
            "chunk_size": 32,
            "l1": {"size_bytes": "4Mi", "pin_memory": False},
            "l2": {"path": str(tmp_path / "l2"), "size_bytes": "8Mi"},
        }
    )
    engine = StorageManager(config)
    lib = RecordingCuda({GPU0: 0})
    devices = CudaDevices(lib, engine.arena)  # type: ignore[arg-type]
    try:
        ipc = IpcTransfers(engine, devices)
        raw = torch.empty(3 * 12 * 2 * 16 * 128 * 2, dtype=torch.int8)
        case = vllm_layers("LBNHC", buffer=raw, seed=4)
        handle = b"\x07" * 64
        lib.exports[handle] = raw
        body = p.RegisterKVRequest(
            device_uuid=GPU0.removeprefix("GPU-"), kv_cache_layout="LBNHC", block_dim=0,
            blocks_per_chunk=2, dtype="bfloat16", itemsize=2,
            layers=[
                p.KVLayerHandle(handle, t.data_ptr() - raw.data_ptr(), tuple(t.shape),
                                tuple(t.stride()))
                for t in case.layers.values()
            ],
        )  # fmt: skip
        ipc.register("s1", body)
        event = b"\x09" * 64
        ks = chunk_keys(2, "through")
        saved = ipc.save("s1", p.SaveBlocksRequest(ks, [[3, 4], [9, 1]], event), "o")
        assert saved.committed == [True, True]
        assert ("event_query", 0, event) in lib.calls

        layers = list(case.layers.values())
        before = chunkref.clone_layers(layers)
        assert ipc.load("s1", p.LoadBlocksRequest(ks, [[6, 7], [0, 11]]), "o").loaded == 2
        for layer, old in zip(layers, before, strict=True):
            for src, dst in ((3, 6), (4, 7), (9, 0), (1, 11)):
                moved = chunkref.page_bytes(case, layer, dst)
                assert torch.equal(moved, chunkref.page_bytes(case, old, src))
        assert ipc.close("s1")
        assert lib.open[raw.data_ptr()] == 0
    finally:
        devices.close()
        engine.close()


# -- the factory on this machine ---------------------------------------------------

FACTORY = (
    "import json; from kvstrata.sidecar.arena import Arena; "
    "from kvstrata.sidecar.transfer.cuda_device import open_cuda_devices; "
    "a = Arena(1 << 16); f, why = open_cuda_devices(a); a.close(); "
    "print(json.dumps([f is None, why]))"
)


def test_without_a_visible_gpu_the_factory_is_none_and_the_reason_says_why() -> None:
    done = subprocess.run(
        [sys.executable, "-c", FACTORY], capture_output=True, text=True, check=True,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, timeout=300,
    )  # fmt: skip
    is_none, why = json.loads(done.stdout)
    assert is_none
    assert why.startswith("CUDA kernels unavailable: ")
    assert "CUDA" in why.removeprefix("CUDA kernels unavailable: ")


def test_the_binding_refuses_runtime_calls_on_the_host_library() -> None:
    host: TransferLibrary = kernels.load_host()
    with pytest.raises(RuntimeError, match="CUDA library only"):
        host.stream_create(0)


def test_the_arena_is_registered_on_the_first_registered_gpu_with_it_current(arena: Arena) -> None:
    # RecordingCuda is the CUDA runtime's double: it records the call order.
    # Registering with no device set would create a context on device 0 (of
    # every GPU of the node, with NVIDIA_VISIBLE_DEVICES=all).
    lib = RecordingCuda({GPU0: 0, GPU1: 1})
    devices = CudaDevices(lib, arena)  # type: ignore[arg-type]
    assert lib.calls == []  # nothing touches CUDA before a worker names its GPU
    devices(GPU1)
    first_register = names(lib.calls).index("host_register")
    assert ("set_device", 1) in lib.calls[:first_register]
    assert all(call == ("host_register", 1) for call in lib.calls if call[0] == "host_register")
    devices.close()
    assert lib.registered == set()


def test_a_save_waiting_for_a_killed_peers_event_frees_the_device_and_its_mapping(
    tmp_path: Path,
) -> None:
    # The vLLM that recorded the event was killed before its forward pass
    # ended: the event never completes (RecordingCuda, the runtime's double,
    # answers "not ready" forever). The save must not hold the device for
    # other sessions, and ending the session must end the wait and unmap.
    import threading

    config = config_from_dict(
        {
            "chunk_size": 32,
            "l1": {"size_bytes": "4Mi", "pin_memory": False},
            "l2": {"path": str(tmp_path / "l2"), "size_bytes": "8Mi"},
        }
    )
    engine = StorageManager(config)
    lib = RecordingCuda({GPU0: 0})
    lib.event_done = False
    lib.event_queried = threading.Event()
    devices = CudaDevices(lib, engine.arena)  # type: ignore[arg-type]
    try:
        ipc = IpcTransfers(engine, devices)
        raw = torch.empty(3 * 12 * 2 * 16 * 128 * 2, dtype=torch.int8)
        case = vllm_layers("LBNHC", buffer=raw, seed=5)
        lib.exports[b"\x07" * 64] = raw
        body = p.RegisterKVRequest(
            device_uuid=GPU0, kv_cache_layout="LBNHC", block_dim=0,
            blocks_per_chunk=2, dtype="bfloat16", itemsize=2,
            layers=[
                p.KVLayerHandle(b"\x07" * 64, t.data_ptr() - raw.data_ptr(), tuple(t.shape),
                                tuple(t.stride()))
                for t in case.layers.values()
            ],
        )  # fmt: skip
        ipc.register("dead", body)
        ipc.register("alive", body)
        ks = chunk_keys(1, "dead-peer")
        saved: list[p.CommitStoreReply] = []
        save = p.SaveBlocksRequest(ks, [[3, 4]], b"\x0d" * 64)
        saver = threading.Thread(target=lambda: saved.append(ipc.save("dead", save, "o")))
        saver.start()
        assert lib.event_queried.wait(10)  # the save is waiting for the event
        # Another session's copy runs meanwhile: the device is not held.
        load = p.LoadBlocksRequest(chunk_keys(1, "absent"), [[0, 1]])
        assert ipc.load("alive", load, "o").loaded == 0
        other = p.SaveBlocksRequest(chunk_keys(1, "alive"), [[5, 6]])
        assert ipc.save("alive", other, "o").committed == [True]
        # The dead worker's session ends (its liveness socket closed).
        assert ipc.close("dead")
        saver.join(10)
        assert not saver.is_alive()
        assert saved[0].committed == [False]  # never committed: its bytes were never copied
        assert engine.acquire(ks[0], "check") is None
        ipc.close("alive")
        assert lib.open[raw.data_ptr()] == 0  # nothing of the dead worker stays mapped
    finally:
        devices.close()
        engine.close()


def test_a_peer_event_that_never_completes_fails_the_save_at_its_deadline(arena: Arena) -> None:
    lib = RecordingCuda({GPU0: 0})
    lib.event_done = False
    device = CudaDevice(lib, GPU0, arena, peer_event_timeout_s=0.0)  # type: ignore[arg-type]
    case = vllm_layers("LBNHC", seed=6)
    plan = plan_from_geometry([TensorGeometry.of(t) for t in case.layers.values()], 0).coalesced()
    lib.calls.clear()
    with pytest.raises(CudaDeviceError, match="did not complete"):
        device.gather(plan, [1, 2], [device.arena_address(0)], 2, b"\x0e" * 64)
    assert "gather" not in names(lib.calls)  # nothing was copied


def _registered_ipc(
    tmp_path: Path, lib: RecordingCuda
) -> tuple[StorageManager, CudaDevices, IpcTransfers, torch.Tensor, p.RegisterKVRequest]:
    config = config_from_dict(
        {
            "chunk_size": 32,
            "l1": {"size_bytes": "4Mi", "pin_memory": False},
            "l2": {"path": str(tmp_path / "l2"), "size_bytes": "8Mi"},
        }
    )
    engine = StorageManager(config)
    devices = CudaDevices(lib, engine.arena)  # type: ignore[arg-type]
    ipc = IpcTransfers(engine, devices)
    raw = torch.empty(3 * 12 * 2 * 16 * 128 * 2, dtype=torch.int8)
    case = vllm_layers("LBNHC", buffer=raw, seed=5)
    lib.exports[b"\x07" * 64] = raw
    body = p.RegisterKVRequest(
        device_uuid=GPU0, kv_cache_layout="LBNHC", block_dim=0,
        blocks_per_chunk=2, dtype="bfloat16", itemsize=2,
        layers=[
            p.KVLayerHandle(b"\x07" * 64, t.data_ptr() - raw.data_ptr(), tuple(t.shape),
                            tuple(t.stride()))
            for t in case.layers.values()
        ],
    )  # fmt: skip
    return engine, devices, ipc, raw, body


def test_a_load_waiting_for_a_killed_peers_event_frees_the_device_and_its_mapping(
    tmp_path: Path,
) -> None:
    # A vLLM killed while its previous step ran: the event the load must follow
    # never completes (RecordingCuda answers "not ready" forever). The load must
    # not hold the device, and ending the session must end the wait and unmap.
    import threading

    lib = RecordingCuda({GPU0: 0})
    engine, devices, ipc, raw, body = _registered_ipc(tmp_path, lib)
    try:
        ipc.register("dead", body)
        ipc.register("alive", body)
        ks = chunk_keys(1, "to-load")
        assert ipc.save("alive", p.SaveBlocksRequest(ks, [[3, 4]]), "o").committed == [True]
        lib.event_done = False
        lib.event_queried = threading.Event()
        loaded: list[p.LoadBlocksReply] = []
        load = p.LoadBlocksRequest(ks, [[6, 7]], after_event=b"\x0d" * 64)
        loader = threading.Thread(target=lambda: loaded.append(ipc.load("dead", load, "o")))
        loader.start()
        assert lib.event_queried.wait(10)  # the load is waiting for the event
        assert not [c for c in lib.calls if c[0] == "scatter"]  # nothing written yet
        # Another session's copy runs meanwhile: the device is not held.
        other = p.SaveBlocksRequest(chunk_keys(1, "alive"), [[5, 6]])
        assert ipc.save("alive", other, "o").committed == [True]
        assert ipc.close("dead")  # the dead worker's liveness socket closed
        loader.join(10)
        assert not loader.is_alive()
        assert loaded[0].loaded == 0  # vLLM, were it alive, would recompute
        assert not [c for c in lib.calls if c[0] == "scatter"]
        assert ipc.fault == ""  # a peer's death is no fault of the sidecar's GPU
        ipc.close("alive")
        assert lib.open[raw.data_ptr()] == 0  # nothing of the dead worker stays mapped
    finally:
        devices.close()
        engine.close()


def test_load_blocks_promotes_a_chunk_only_from_the_tiers_its_request_allows(
    tmp_path: Path,
) -> None:
    # A chunk saved over ipc, written behind to L2, then pushed out of L1: a
    # LOAD_BLOCKS whose request may load from L1 only is a miss and promotes
    # nothing; one that allows L2 promotes it and loads it.
    from kvstrata.sidecar.objformat import ChunkMeta

    lib = RecordingCuda({GPU0: 0})
    engine, devices, ipc, _, body = _registered_ipc(tmp_path, lib)
    try:
        ipc.register("s", body)
        ks = chunk_keys(1, "tiered")
        assert ipc.save("s", p.SaveBlocksRequest(ks, [[3, 4]]), "o").committed == [True]
        assert engine.flush(30)
        slot = engine.acquire(ks[0], "size")
        assert slot is not None
        nbytes = slot.length
        engine.release(slot)
        flood = chunk_keys((6 << 20) // nbytes, "flood")  # 6 MiB through a 4 MiB L1
        for key in flood:
            assert engine.put(key, b"\x01" * nbytes, ChunkMeta(dtype="uint8", shape=(nbytes,)))
        assert engine.flush(30)
        assert engine.lookup(ks).tiers == ["l2"]
        l1_only = p.LoadBlocksRequest(ks, [[6, 7]], load_tiers=frozenset({"l1"}))
        wire = p.LoadBlocksRequest.from_wire(l1_only.to_wire())
        assert wire.load_tiers == frozenset({"l1"})  # as the connector sends it
        assert ipc.load("s", wire, "o").loaded == 0
        assert engine.lookup(ks).tiers == ["l2"]  # not promoted
        from_l2 = p.LoadBlocksRequest(ks, [[6, 7]], load_tiers=frozenset({"l1", "l2"}))
        assert ipc.load("s", from_l2, "o").loaded == 1
        assert engine.lookup(ks).tiers == ["l1"]
    finally:
        ipc.close("s")
        devices.close()
        engine.close()


class WedgedCuda(RecordingCuda):
    """RecordingCuda whose scatter blocks until the test releases it: a CUDA call
    that does not return (a stand-in for a hung driver call, named as such)."""

    def __init__(self, devices: dict[str, int]) -> None:
        super().__init__(devices)
        import threading

        self.entered = threading.Event()
        self.release = threading.Event()

    def scatter(self, plan: CopyPlan, ids: Any, chunks: Any, per_chunk: int, **kw: Any) -> None:
        self.entered.set()
        assert self.release.wait(30)
        super().scatter(plan, ids, chunks, per_chunk, **kw)


def test_closing_a_session_never_waits_for_its_wedged_copy_whose_end_closes_the_handles(
    tmp_path: Path,
) -> None:
    import threading

    lib = WedgedCuda({GPU0: 0})
    engine, devices, ipc, raw, body = _registered_ipc(tmp_path, lib)
    try:
        ipc.register("wedged", body)
        ks = chunk_keys(1, "wedged")
        assert ipc.save("wedged", p.SaveBlocksRequest(ks, [[3, 4]]), "o").committed == [True]
        load = p.LoadBlocksRequest(ks, [[6, 7]])
        loader = threading.Thread(target=lambda: ipc.load("wedged", load, "o"))
        loader.start()
        assert lib.entered.wait(10)
        closed = threading.Event()
        closer = threading.Thread(target=lambda: (ipc.close("wedged"), closed.set()))
        closer.start()
        # The liveness thread is free again while the copy still runs...
        assert closed.wait(10)
        assert len(ipc) == 0
        assert lib.open[raw.data_ptr()] == 1  # ...and the copy's memory stays mapped
        lib.release.set()
        loader.join(10)
        assert not loader.is_alive()
        assert lib.open[raw.data_ptr()] == 0  # the copy's end closed it
    finally:
        lib.release.set()
        devices.close()
        engine.close()


def test_closing_from_a_thread_that_chose_no_device_runs_every_call_on_the_sessions_gpu(
    arena: Arena,
) -> None:
    # The sidecar sees every GPU of the node; its vLLM's is device 1 here. A thread
    # that never chose a device (shutdown, the liveness thread) is on device 0 for
    # the runtime, and its first call there would create a context on another pod's
    # GPU: closing must choose device 1 before anything else.
    lib = RecordingCuda({GPU0: 0, GPU1: 1})
    devices = CudaDevices(lib, arena)  # type: ignore[arg-type]
    devices(GPU1)
    lib.calls.clear()
    lib.current = 0  # what a fresh thread's runtime state says

    seen: list[tuple[str, int]] = []
    for name in ("synchronize", "stream_destroy", "host_unregister"):
        wrapped = getattr(lib, name)

        def record(*args: Any, _name: str = name, _fn: Any = wrapped) -> Any:
            seen.append((_name, lib.current))
            return _fn(*args)

        setattr(lib, name, record)
    devices.close()

    assert seen == [("synchronize", 1), ("stream_destroy", 1), ("host_unregister", 1)]
    assert ("set_device", 0) not in lib.calls


GUARD_TRACE = r"""
#include <cstdio>
#include "kvs_device_guard.h"

// A recording stand-in for the CUDA runtime (named as such): the device the thread
// has current, whether a context is current, and every cudaSetDevice.
struct Recording {
  int current;
  bool context;
  int sets = 0;
  int set_to[8];
  int get_device(int* d) { *d = current; return 0; }
  int set_device(int d) { set_to[sets++] = d; current = d; context = true; return 0; }
  bool has_current_context() { return context; }
};

int main() {
  const int cases[][3] = {{0, 0, 1}, {0, 1, 1}, {2, 1, 1}, {1, 1, 1}, {1, 0, 1}};
  for (const auto& c : cases) {
    Recording rt{c[0], c[1] != 0};
    { kvs::DeviceGuard<Recording> guard(rt, c[2]); }
    std::printf("%d %d %d ->", c[0], c[1], c[2]);
    for (int i = 0; i < rt.sets; ++i) std::printf(" %d", rt.set_to[i]);
    std::printf("\n");
  }
  return 0;
}
"""


def test_the_device_guard_gives_a_device_back_only_where_a_context_was_current(
    tmp_path: Path,
) -> None:
    # csrc/kvs_device_guard.h compiled with the host compiler over a recording runtime.
    cxx = csrc_build.find_cxx()
    if cxx is None:
        pytest.skip("no C++ compiler on this machine")
    source = tmp_path / "guard.cpp"
    source.write_text(GUARD_TRACE)
    binary = tmp_path / "guard"
    csrc = csrc_build.repo_csrc_dir()
    assert csrc is not None
    subprocess.run([cxx, "-std=c++17", f"-I{csrc}", "-o", str(binary), str(source)], check=True)
    trace = subprocess.run([str(binary)], capture_output=True, text=True, check=True).stdout
    assert trace.splitlines() == [
        "0 0 1 -> 1",  # a fresh thread: switch to the target, never set device 0
        "0 1 1 -> 1 0",  # torch had device 0 current (its context exists): given back
        "2 1 1 -> 1 2",
        "1 1 1 ->",  # already there: no call at all
        "1 0 1 ->",
    ]
