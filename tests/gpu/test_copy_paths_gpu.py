"""ipc mode's two copy paths on a real GPU: staging moves the bytes zero-copy moves.

``CudaDevice`` with ``copy_path="staging"`` (kernel into a device buffer,
``cudaMemcpyAsync`` to the pinned arena, in batches) against
``copy_path="zero_copy"`` (kernel straight into the pinned arena), both
driven by the csrc CUDA library with KV tensors in device memory. The
staging buffer is made to hold two chunks, so five chunks take three
batches. Expected bytes also come from kvstrata.testing.chunkref (torch
indexing). Skipped where torch sees no CUDA device.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvstrata.sidecar.arena import Arena
from kvstrata.sidecar.transfer.cuda_device import CudaDevice
from kvstrata.sidecar.transfer.kernel_binding import TransferLibrary
from kvstrata.sidecar.transfer.kernels import cuda_unavailable_reason, load_cuda
from kvstrata.sidecar.transfer.plan import CopyPlan, TensorGeometry, plan_from_geometry
from kvstrata.testing import chunkref
from kvstrata.testing.kvlayouts import KVLayoutCase, vllm_layers

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]

CHUNKS = 5


@pytest.fixture(scope="module")
def lib() -> TransferLibrary:
    lib = load_cuda()
    assert lib is not None, (
        f"torch sees a GPU but the CUDA kernels do not: {cuda_unavailable_reason()}"
    )
    return lib


@pytest.fixture
def arena() -> Iterator[Arena]:
    a = Arena(8 << 20)
    yield a
    a.close()


def case_and_plan(layout: str, seed: int) -> tuple[KVLayoutCase, CopyPlan]:
    case = vllm_layers(layout, device="cuda", seed=seed)
    # The sidecar's stream does not wait for torch's: the KV must be written first
    # (in ipc mode vLLM's event says so).
    torch.cuda.synchronize()
    plan = plan_from_geometry([TensorGeometry.of(t) for t in case.layers.values()], 0).coalesced()
    return case, plan


def devices(lib: TransferLibrary, arena: Arena, chunk_nbytes: int) -> tuple[CudaDevice, CudaDevice]:
    """Zero-copy and staging devices of GPU 0 over one arena registration."""
    uuid = str(torch.cuda.get_device_properties(0).uuid)
    zero = CudaDevice(lib, uuid, arena)
    staged = CudaDevice(
        lib, uuid, arena, zero.registration, copy_path="staging",
        staging_bytes=2 * chunk_nbytes + 4096,
    )  # fmt: skip
    return zero, staged


def arena_bytes(arena: Arena) -> torch.Tensor:
    return torch.frombuffer(arena.buffer, dtype=torch.uint8)


@pytest.mark.parametrize("layout", ["LBNHC", "BLNHC"])
def test_a_staged_gather_writes_the_arena_bytes_a_zero_copy_gather_writes(
    lib: TransferLibrary, arena: Arena, layout: str
) -> None:
    case, plan = case_and_plan(layout, seed=21)
    nbytes = plan.chunk_nbytes(2)
    zero, staged = devices(lib, arena, nbytes)
    try:
        ids = [3, 7, 0, 11, -1, 5, 2, 2, 9, 1]
        region = CHUNKS * nbytes
        arena_bytes(arena)[: 2 * region] = chunkref.POISON

        zero.gather(plan, ids, [zero.arena_address(i * nbytes) for i in range(CHUNKS)], 2, None)
        staged.gather(
            plan, ids, [staged.arena_address(region + i * nbytes) for i in range(CHUNKS)], 2, None
        )

        got = arena_bytes(arena)
        assert torch.equal(got[region : 2 * region], got[:region])
        for c in range(CHUNKS):
            expected = chunkref.chunk_bytes(case, ids[2 * c : 2 * c + 2], chunkref.POISON).cpu()
            assert torch.equal(got[region + c * nbytes : region + (c + 1) * nbytes], expected)
        assert staged.fallbacks == 0
    finally:
        staged.close()
        zero.close()


@pytest.mark.parametrize("layout", ["LBNHC", "BLNHC"])
def test_a_staged_scatter_writes_the_kv_bytes_a_zero_copy_scatter_writes(
    lib: TransferLibrary, arena: Arena, layout: str
) -> None:
    case_zero, plan_zero = case_and_plan(layout, seed=22)
    case_staged, plan_staged = case_and_plan(layout, seed=22)
    nbytes = plan_zero.chunk_nbytes(2)
    zero, staged = devices(lib, arena, nbytes)
    try:
        chunks = torch.randint(0, 256, (CHUNKS * nbytes,), dtype=torch.uint8)
        arena_bytes(arena)[: chunks.numel()] = chunks
        ids = [4, -1, 8, 10, 0, 1, -1, 6, 3, 2]
        addresses = [zero.arena_address(i * nbytes) for i in range(CHUNKS)]

        zero.scatter(plan_zero, ids, addresses, 2)
        staged.scatter(plan_staged, ids, addresses, 2)

        written_zero = chunkref.storage_bytes(list(case_zero.layers.values()))
        written_staged = chunkref.storage_bytes(list(case_staged.layers.values()))
        for a, b in zip(written_zero, written_staged, strict=True):
            assert torch.equal(a, b)
        for c, pair in ((1, [8, 10]), (2, [0, 1]), (4, [3, 2])):
            written = chunkref.chunk_bytes(case_staged, pair, 0).cpu()
            assert torch.equal(written, chunks[c * nbytes : (c + 1) * nbytes])
    finally:
        staged.close()
        zero.close()
