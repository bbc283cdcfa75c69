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

import ctypes
import mmap
import os
from collections.abc import Callable, Sequence

from kvstrata.sidecar.protocol import IPC_HANDLE_BYTES
from kvstrata.sidecar.transfer import kernels
from kvstrata.sidecar.transfer.plan import CopyPlan

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
