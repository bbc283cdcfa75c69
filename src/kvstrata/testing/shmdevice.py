"""A stand-in GPU for ipc-mode tests on machines without one (a test double).

:class:`SharedMemoryDevice` implements the sidecar's
:class:`~kvstrata.sidecar.transfer.ipc_device.TransferDevice` with host memory:
a "CUDA IPC handle" is the name of a ``/dev/shm`` segment (64 bytes,
zero-padded) that the "vLLM" side fills with its KV tensors, "opening" it
maps the segment, and copies run through the host build of the ``csrc``
kernels (the same index code as the CUDA kernels). Everything else on the
ipc path (protocol, registration, plans, engine slots, session ends) is
the real code. What only a GPU can show (CUDA IPC, events, DMA) is
covered by ``kvstrata selftest gpu`` and the ``gpu`` tests.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvstrata.sidecar.protocol import IPC_HANDLE_BYTES
from kvstrata.sidecar.transfer import kernels
from kvstrata.sidecar.transfer.plan import CopyPlan

if TYPE_CHECKING:
    import torch

    from kvstrata.sidecar.ipc_messages import RegisterKVRequest

SHM_DIR = "/dev/shm"


def handle_for(segment_name: str) -> bytes:
    """The 64-byte stand-in handle naming a shared-memory segment."""
    raw = segment_name.encode()
    if len(raw) > IPC_HANDLE_BYTES or b"/" in raw or b"\0" in raw:
        raise ValueError(f"segment name {segment_name!r} cannot be a handle")
    return raw.ljust(IPC_HANDLE_BYTES, b"\0")


class SharedMemoryDevice:
    """See the module docstring. ``arena_base`` is the arena's address here."""

    def __init__(self, arena_base: int) -> None:
        self.arena_base = arena_base
        self.lib = kernels.load_host()
        self._maps: dict[int, tuple[mmap.mmap, ctypes.Array[ctypes.c_char]]] = {}
        self.events_waited: list[bytes] = []

    @property
    def open_handles(self) -> int:
        return len(self._maps)

    def open_memory(self, handle: bytes) -> int:
        name = handle.rstrip(b"\0").decode()
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_RDWR)  # OSError names a missing segment
        try:
            size = os.fstat(fd).st_size
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        view = (ctypes.c_char * size).from_buffer(mm)
        address = ctypes.addressof(view)
        self._maps[address] = (mm, view)
        return address

    def close_memory(self, address: int) -> None:
        mm, view = self._maps.pop(address)
        del view
        mm.close()

    def mapped_nbytes(self, address: int) -> int | None:
        return len(self._maps[address][0])

    def gather(
        self,
        plan: CopyPlan,
        block_ids: Sequence[int],
        chunk_addresses: Sequence[int],
        blocks_per_chunk: int,
        after_event: bytes | None,
        cancelled: Callable[[], bool] | None = None,
    ) -> None:
        if after_event is not None:
            self.events_waited.append(after_event)
        self.lib.gather(plan, block_ids, chunk_addresses, blocks_per_chunk)

    def scatter(
        self,
        plan: CopyPlan,
        block_ids: Sequence[int],
        chunk_addresses: Sequence[int],
        blocks_per_chunk: int,
        after_event: bytes | None = None,
        cancelled: Callable[[], bool] | None = None,
    ) -> None:
        if after_event is not None:
            self.events_waited.append(after_event)
        self.lib.scatter(plan, block_ids, chunk_addresses, blocks_per_chunk)

    def arena_address(self, offset: int) -> int:
        return self.arena_base + offset


class SharedKV:
    """vLLM's KV (layout LBNHC, bf16) built inside a shared-memory segment: the
    "vLLM" side of every in-process ipc test, registered with the GPU known as
    ``gpu_uuid``. ``close()`` removes the segment."""

    def __init__(self, gpu_uuid: str, num_blocks: int = 12) -> None:
        import torch

        from kvstrata.testing.kvlayouts import vllm_layers

        self.gpu_uuid = gpu_uuid
        self.name = f"kvstrata-test-kv-{uuid.uuid4().hex[:12]}"
        nbytes = 3 * num_blocks * 2 * 16 * 128 * 2  # layers, blocks, heads, tokens, bf16 content
        fd = os.open(os.path.join(SHM_DIR, self.name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            self.mm = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        raw = torch.frombuffer(self.mm, dtype=torch.int8)
        self.base = raw.data_ptr()
        self.case = vllm_layers(
            "LBNHC", num_blocks=num_blocks, heads=2, tokens=16, content=128, buffer=raw
        )

    def registration(self, gpu: str | None = None, blocks_per_chunk: int = 2) -> RegisterKVRequest:
        """The REGISTER_KV body for this KV (on ``gpu``, this KV's own GPU unless named)."""
        from kvstrata.sidecar import protocol as p

        layers = [
            p.KVLayerHandle(
                handle=handle_for(self.name),
                offset=t.data_ptr() - self.base,
                shape=tuple(t.shape),
                strides=tuple(t.stride()),
            )
            for t in self.case.layers.values()
        ]
        return p.RegisterKVRequest(
            device_uuid=self.gpu_uuid if gpu is None else gpu,
            kv_cache_layout="LBNHC",
            block_dim=0,
            blocks_per_chunk=blocks_per_chunk,
            dtype="bfloat16",
            itemsize=2,
            layers=layers,
        )

    def block(self, kv: torch.Tensor, b: int) -> torch.Tensor:
        """Block ``b`` of one layer's KV, as bytes."""
        import torch

        return kv[b].contiguous().view(torch.uint8).flatten()

    def close(self) -> None:
        self.case.layers.clear()
        # A view may still be alive in the test's process; the unlink suffices.
        with contextlib.suppress(BufferError):
            self.mm.close()
        os.unlink(os.path.join(SHM_DIR, self.name))
