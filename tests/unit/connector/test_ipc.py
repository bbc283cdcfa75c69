"""What the worker sends in REGISTER_KV, from the handle torch really exports.

No GPU here: ``_share_cuda_`` is answered by a double (named so below) that
returns the tuple torch 2.13's ``THPStorage_shareCuda`` returns, with the
storage handle laid out as ``CUDACachingAllocator::shareIpcHandle`` writes
it (torch/include/c10/cuda/CUDACachingAllocator.h, ``ShareableHandle``): a
format-version byte, a type byte (``'c'``: cudaMalloc segment, ``'e'``:
expandable segment), then the 64-byte ``cudaIpcMemHandle_t`` for ``'c'``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstrata.connector import ipc
from kvstrata.connector.client import SidecarClient
from kvstrata.sidecar import protocol as p
from kvstrata.sidecar.keys import Namespace

MEM_HANDLE = bytes(range(64))  # stands for a cudaIpcMemHandle_t
# SHAREABLE_HANDLE_VERSION as torch 2.13's CUDA build writes it (its
# libc10_cuda.so; the CPU wheel here has no CUDA allocator to read it from).
TORCH_HANDLE_VERSION = 3


def torch_storage_handle(
    kind: bytes, payload: bytes = MEM_HANDLE, version: int = TORCH_HANDLE_VERSION
) -> bytes:
    """A storage handle as ``CUDACachingAllocator::shareIpcHandle`` writes it:
    the version byte, the type byte, the payload."""
    return bytes([version]) + kind + payload


class StorageDouble:
    """A double of a CUDA UntypedStorage: counts its exports."""

    def __init__(self, handle: bytes, nbytes: int, offset_in_allocation: int) -> None:
        self.handle, self.nbytes, self.offset = handle, nbytes, offset_in_allocation
        self.exports = 0

    def data_ptr(self) -> int:
        return 0x7F0000000000 + self.offset

    def _share_cuda_(self) -> tuple[Any, ...]:
        self.exports += 1
        # (device, handle, size_bytes, offset_bytes, ref_counter_handle,
        #  ref_counter_offset, event_handle, event_sync_required); the counter
        # file is a shared-memory name, one int64 slot per export.
        counter_file = f"/torch_4242_{id(self)}".encode()
        return (0, self.handle, self.nbytes, self.offset, counter_file, self.exports - 1,
                b"\0" * 64, False)  # fmt: skip


class TensorDouble:
    """A double of a CUDA KV tensor: a real CPU tensor's geometry over a StorageDouble."""

    def __init__(self, real: torch.Tensor, storage: StorageDouble) -> None:
        self.real, self.storage = real, storage
        self.shape, self.dtype, self.device = real.shape, real.dtype, torch.device("cuda", 0)

    def untyped_storage(self) -> StorageDouble:
        return self.storage

    def stride(self) -> tuple[int, ...]:
        return self.real.stride()

    def storage_offset(self) -> int:
        return self.real.storage_offset()

    def element_size(self) -> int:
        return self.real.element_size()


def layers_over(storage: StorageDouble, n: int = 3) -> list[Any]:
    whole = torch.zeros(n, 4, 2, 16, 8, dtype=torch.bfloat16)  # [layer, B, H, N, C]
    return [TensorDouble(whole[i], storage) for i in range(n)]


@pytest.fixture(autouse=True)
def no_cuda_properties(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ipc, "device_uuid", lambda device: "GPU-00000000-test")


def register(
    tensors: list[Any], references: ipc.IpcReferences | None = None
) -> p.RegisterKVRequest:
    return ipc.kv_registration(
        tensors,
        references=references if references is not None else ipc.IpcReferences(),
        kv_cache_layout="LBHNC",
        block_dim=0,
        blocks_per_chunk=2,
    )


class ReleasedCounters:
    """A double of ``UntypedStorage._release_ipc_counter_cuda``, which this CPU
    build of torch has but refuses ("CUDA is not available"): records each
    (counter file, slot) given back."""

    def __init__(self) -> None:
        self.released: list[tuple[bytes, int]] = []

    def __call__(self, counter_file: bytes, slot: int) -> None:
        self.released.append((counter_file, slot))


@pytest.fixture
def released(monkeypatch: pytest.MonkeyPatch) -> ReleasedCounters:
    # The real function exists in the installed torch with this name.
    assert callable(torch.UntypedStorage._release_ipc_counter_cuda)
    double = ReleasedCounters()
    monkeypatch.setattr(torch.UntypedStorage, "_release_ipc_counter_cuda", double)
    return double


def test_each_exports_ipc_reference_is_given_back_once_when_released(
    released: ReleasedCounters,
) -> None:
    first = StorageDouble(torch_storage_handle(b"c"), 3 * 8192, 0)
    second = StorageDouble(torch_storage_handle(b"c"), 3 * 8192, 1 << 20)  # another allocation
    references = ipc.IpcReferences()
    register(layers_over(first, 3) + layers_over(second, 2), references)
    # One reference per allocation exported, named as _share_cuda_ returned it.
    assert len(references) == 2 and not released.released
    references.release()
    references.release()  # a second close gives nothing back twice
    assert released.released == [
        (f"/torch_4242_{id(first)}".encode(), 0),
        (f"/torch_4242_{id(second)}".encode(), 0),
    ]


def test_an_export_refused_part_way_gives_back_the_references_it_took(
    released: ReleasedCounters,
) -> None:
    plain = StorageDouble(torch_storage_handle(b"c"), 3 * 8192, 0)
    expandable = StorageDouble(torch_storage_handle(b"e", b"\x01" * 20), 3 * 8192, 1 << 20)
    references = ipc.IpcReferences()
    with pytest.raises(ipc.IpcExportError):
        register(layers_over(plain, 1) + layers_over(expandable, 1), references)
    assert len(references) == 0
    assert released.released == [
        (f"/torch_4242_{id(plain)}".encode(), 0),
        (f"/torch_4242_{id(expandable)}".encode(), 0),
    ]


def test_the_cudamalloc_handle_torch_exports_registers_its_64_byte_ipc_handle() -> None:
    layer_bytes = 4 * 2 * 16 * 8 * 2  # [B, H, N, C] of bf16
    storage = StorageDouble(torch_storage_handle(b"c"), 3 * layer_bytes, offset_in_allocation=512)
    body = register(layers_over(storage))
    assert [layer.handle for layer in body.layers] == [MEM_HANDLE] * 3
    # Each layer's offset: the storage's offset in the allocation plus the view's.
    assert [layer.offset for layer in body.layers] == [
        512,
        512 + layer_bytes,
        512 + 2 * layer_bytes,
    ]
    assert {layer.mapped_nbytes for layer in body.layers} == {512 + 3 * layer_bytes}
    # The body crosses the wire as it was built.
    wire = p.RegisterKVRequest.from_wire(body.to_wire())
    assert wire.layers[2].handle == MEM_HANDLE
    assert wire.layers[2].offset == 512 + 2 * layer_bytes


def test_the_venv_runs_the_torch_whose_handle_format_the_fixture_encodes() -> None:
    # The fixture's version byte is torch 2.13's; a torch upgrade must revisit it.
    assert torch.__version__.startswith("2.13.")
    # The handle is an opaque string beside the offset (ShareableHandle in the
    # installed headers): nothing else the connector reads is in that struct.
    header = Path(torch.__file__).parent / "include/c10/cuda/CUDACachingAllocator.h"
    text = " ".join(header.read_text().split())
    assert "struct ShareableHandle { ptrdiff_t offset; std::string handle; };" in text


@pytest.mark.parametrize("version", [1, 2, 3])
def test_a_cudamalloc_handle_of_every_torch_since_the_versioned_format_is_read(
    version: int,
) -> None:
    # 1: the format's first release, 2: through torch 2.12, 3: torch 2.13.
    raw = torch_storage_handle(b"c", version=version)
    assert ipc.cuda_memory_handle(raw) == MEM_HANDLE


def test_a_bare_64_byte_handle_of_older_torch_is_still_read() -> None:
    body = register(layers_over(StorageDouble(MEM_HANDLE, 3 * 8192, 0), 1))
    assert body.layers[0].handle == MEM_HANDLE


def test_one_allocation_shared_by_every_layer_is_exported_once() -> None:
    storage = StorageDouble(torch_storage_handle(b"c"), 3 * 8192, 0)
    register(layers_over(storage, 3))
    assert storage.exports == 1


def test_an_expandable_segment_is_refused_naming_the_allocator_setting() -> None:
    storage = StorageDouble(torch_storage_handle(b"e", b"\x01" * 20), 3 * 8192, 0)
    with pytest.raises(ipc.IpcExportError, match="expandable_segments"):
        register(layers_over(storage))


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (bytes([4]) + b"c" + MEM_HANDLE, "format version 4"),
        (bytes([TORCH_HANDLE_VERSION]) + b"x" + MEM_HANDLE, "unknown type byte"),
        (bytes([TORCH_HANDLE_VERSION]) + b"c" + MEM_HANDLE[:60], "60 bytes"),
    ],
    ids=["future-version", "unknown-type", "short-payload"],
)
def test_a_handle_of_another_form_is_refused_with_the_reason(raw: bytes, reason: str) -> None:
    with pytest.raises(ipc.IpcExportError, match=reason):
        ipc.cuda_memory_handle(raw)


def test_a_worker_whose_kv_cannot_be_exported_uses_host_mode_and_says_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # No sidecar is needed to decide this: the client never asks for ipc.
    client = SidecarClient(
        "ipc:///nonexistent/kvstrata.sock", Namespace(model="m"), role="worker", call_timeout_s=0.5
    )
    try:
        storage = StorageDouble(torch_storage_handle(b"e", b"\x01" * 20), 3 * 8192, 0)
        with caplog.at_level(logging.WARNING):
            try:
                register(layers_over(storage))
            except ipc.IpcExportError as exc:
                client.ipc_unavailable(f"cannot export the KV: {exc}")
        assert client.errors.get("ipc_fallback") == 1
        assert "expandable_segments" in client.ipc_fallback_reason
        assert any("expandable_segments" in r.getMessage() for r in caplog.records)
    finally:
        client.close()
