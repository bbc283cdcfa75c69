"""The IPC references the worker's KV exports take are given back (real GPU).

``_share_cuda_`` sets a counter in a shared-memory file (``/dev/shm``) to 1
for the consumer; the sidecar never gives it back (it opens the raw
handle), so the worker does at its end (:class:`~kvstrata.connector.ipc.IpcReferences`).
Without that, freeing the KV leaves it in torch's "limbo" and the process
warns at exit that it died with shared tensors outstanding. Skipped where
torch sees no CUDA device.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvstrata.connector import ipc

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]

LIMBO_WARNING = "Producer process has been terminated before all shared CUDA tensors released"


# The counter file is a RefcountedMapAllocator mapping: its first 64 bytes hold the
# mapping's own reference count, the data (the int64 counters) starts after them
# (aten/src/ATen/MapAllocator.cpp: map_alloc_alignment = 64, data() = base + 64).
# Seen on an H100 with torch 2.11: reading slot 0 at offset 0 found the mapping's
# count (1), unchanged by the release.
MAP_ALLOC_ALIGNMENT = 64


def counter(counter_file: bytes, slot: int) -> int:
    """The int64 in slot ``slot`` of torch's shared-memory counter file."""
    path = Path("/dev/shm") / counter_file.decode().lstrip("/")
    with path.open("rb") as f:
        f.seek(MAP_ALLOC_ALIGNMENT + 8 * slot)
        return int.from_bytes(f.read(8), "little", signed=True)


def register(kv: torch.Tensor, references: ipc.IpcReferences) -> None:
    ipc.kv_registration(
        [kv[0], kv[1]], references=references, kv_cache_layout="LBNHC", block_dim=0,
        blocks_per_chunk=2,
    )  # fmt: skip


def test_the_counter_torch_set_for_the_consumer_drops_to_zero_when_released() -> None:
    kv = torch.zeros(2, 8, 16, 4, 64, dtype=torch.bfloat16, device="cuda")
    references = ipc.IpcReferences()
    register(kv, references)
    ((counter_file, slot),) = references.taken()  # one allocation, one export
    assert counter(counter_file, slot) == 1
    references.release()
    assert counter(counter_file, slot) == 0


SCRIPT = """
import torch
from kvstrata.connector import ipc
kv = torch.zeros(2, 8, 16, 4, 64, dtype=torch.bfloat16, device="cuda")
references = ipc.IpcReferences()
ipc.kv_registration([kv[0], kv[1]], references=references, kv_cache_layout="LBNHC",
                    block_dim=0, blocks_per_chunk=2)
references.release()
del kv
torch.cuda.synchronize()
"""


def test_a_worker_that_gave_its_references_back_exits_without_the_limbo_warning() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, check=True
    )
    assert LIMBO_WARNING not in done.stderr
