"""The storage handle the installed torch's CUDA build exports is read, and its
version byte is the one the connector was written against (real GPU).

The CPU wheel has no CUDA allocator to read ``SHAREABLE_HANDLE_VERSION``
from; here torch writes it. Skipped where torch sees no CUDA device.
"""

from __future__ import annotations

import pytest
import torch

from kvstrata.connector import ipc
from kvstrata.sidecar import protocol as p

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]


def test_the_handle_torch_exports_here_parses_to_a_64_byte_ipc_handle() -> None:
    kv = torch.zeros(2, 8, 16, 4, 64, dtype=torch.bfloat16, device="cuda")
    references = ipc.IpcReferences()
    try:
        shared = kv.untyped_storage()._share_cuda_()
        references.take(bytes(shared[4]), int(shared[5]))
        raw = shared[1]
        handle = ipc.cuda_memory_handle(raw)
        assert len(handle) == p.IPC_HANDLE_BYTES
        if len(raw) != p.IPC_HANDLE_BYTES:  # the versioned format
            major, minor = (int(x) for x in torch.__version__.split(".")[:2])
            assert raw[0] in ipc.SHAREABLE_HANDLE_VERSIONS
            if (major, minor) >= (2, 13):
                assert raw[0] == 3  # what the issue read in torch 2.13's libc10_cuda
            assert raw[1] == ord("c")
    finally:
        references.release()
