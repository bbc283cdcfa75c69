"""The GPU checks of ``kvstrata selftest gpu`` under pytest, and the ipc-mode CUDA calls.

Each selftest check is one test (the same functions the command runs), so a
GPU CI job and an operator on a node run the same code. Skipped where torch
sees no CUDA device.
"""

from __future__ import annotations

import pytest
import torch

from kvstrata.sidecar.transfer.kernel_binding import TransferLibrary
from kvstrata.sidecar.transfer.kernels import cuda_unavailable_reason, load_cuda
from kvstrata.testing import chunkref, gpuipc, selftest
from kvstrata.testing.kvlayouts import vllm_layers

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]


@pytest.fixture(scope="module")
def lib() -> TransferLibrary:
    lib = load_cuda()
    assert lib is not None, (
        f"torch sees a GPU but the CUDA kernels do not: {cuda_unavailable_reason()}"
    )
    return lib


def test_the_cuda_kernels_match_the_torch_reference_on_every_layout_and_dtype(
    lib: TransferLibrary,
) -> None:
    selftest.check_kernels(lib)


def test_the_connector_torch_copier_matches_the_reference_on_cuda_tensors() -> None:
    selftest.check_torch_copier()


def test_kv_stored_from_one_process_over_cuda_ipc_loads_byte_exact_into_another(
    lib: TransferLibrary,
) -> None:
    gpuipc.check_ipc_round_trip(lib)


def test_gpu_memory_of_a_killed_exporter_comes_back_once_its_handle_is_closed(
    lib: TransferLibrary,
) -> None:
    gpuipc.check_handle_cleanup(lib)


def test_host_mode_loads_on_the_connectors_stream_are_ordered_before_attention_reads() -> None:
    from kvstrata.testing import gpuconnector

    gpuconnector.check_connector_stream()


def test_a_worker_killed_while_the_sidecar_waits_for_its_event_wedges_nothing(
    lib: TransferLibrary,
) -> None:
    from kvstrata.testing import gpupeers

    gpupeers.check_killed_peer(lib)


def test_the_device_torch_names_is_found_by_its_uuid_with_or_without_the_gpu_prefix(
    lib: TransferLibrary,
) -> None:
    index = torch.cuda.current_device()
    uuid = str(torch.cuda.get_device_properties(index).uuid)
    assert lib.device_by_uuid(uuid) == index
    assert lib.device_by_uuid(f"GPU-{uuid.upper()}") == index
    with pytest.raises(Exception, match="cudaErrorInvalidDevice"):
        lib.device_by_uuid("GPU-00000000-0000-0000-0000-000000000000")
    free, total = lib.mem_get_info(index)
    assert 0 < free <= total


def test_memory_torch_pinned_is_used_as_it_is_and_leaves_no_error_for_the_next_launch(
    lib: TransferLibrary,
) -> None:
    # torch's registration (flags 0) answers "already registered"; that answer must
    # not surface as the error of the next kernel launch on this thread.
    host = torch.empty(1 << 20, dtype=torch.uint8)
    assert int(torch.cuda.cudart().cudaHostRegister(host.data_ptr(), host.numel(), 0)) == 0
    try:
        address, registered = lib.host_register(host.data_ptr(), host.numel())
        assert not registered
        assert address != 0
        case = vllm_layers("LBNHC", device="cuda", seed=1)
        plan = selftest._plan(list(case.layers.values()), 0)
        torch.cuda.synchronize()
        stream = lib.stream_create(torch.cuda.current_device())
        try:
            lib.set_device(torch.cuda.current_device())
            lib.gather(plan, [1, 2], [address], 2, stream=stream)
            lib.synchronize(stream)
        finally:
            lib.stream_destroy(torch.cuda.current_device(), stream)
        want = chunkref.chunk_bytes(case, [1, 2], chunkref.POISON).cpu()
        assert torch.equal(host[: want.numel()], want)
    finally:
        torch.cuda.cudart().cudaHostUnregister(host.data_ptr())


def test_memory_nothing_pinned_is_registered_mapped_and_unregistered(lib: TransferLibrary) -> None:
    host = torch.empty(1 << 20, dtype=torch.uint8)
    address, registered = lib.host_register(host.data_ptr(), host.numel())
    assert registered
    assert address != 0
    lib.host_unregister(host.data_ptr())


def test_a_worker_killed_while_a_load_waits_for_its_event_wedges_nothing(
    lib: TransferLibrary,
) -> None:
    from kvstrata.testing import gpupeers

    gpupeers.check_killed_peer_during_load(lib)


def test_a_sidecar_process_holds_a_context_on_its_workers_gpu_and_no_other() -> None:
    from kvstrata.testing import gpukit

    gpukit.check_device_context()


@pytest.mark.parametrize("src_access_any", [False, True], ids=["stream-order", "any-order"])
def test_one_batched_dma_call_moves_every_page_run_byte_exact(
    lib: TransferLibrary, src_access_any: bool
) -> None:
    from kvstrata.bench.transfer import dma_descriptors

    case = vllm_layers("LBNHC", device="cuda", seed=2)
    plan = selftest._plan(list(case.layers.values()), 0)
    ids = chunkref.random_block_ids(case.num_blocks, 8, seed=3)
    host = torch.full((2 * plan.chunk_nbytes(4),), chunkref.POISON, dtype=torch.uint8)
    host = host.pin_memory()
    chunks = [host.data_ptr(), host.data_ptr() + plan.chunk_nbytes(4)]
    kv, dst, sizes = dma_descriptors(plan, ids, chunks, 4)
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    lib.memcpy_batch_async(dst, kv, sizes, stream.cuda_stream, src_access_any=src_access_any)
    stream.synchronize()
    want = torch.cat([chunkref.chunk_bytes(case, ids[c * 4 : (c + 1) * 4], 0) for c in range(2)])
    assert torch.equal(host, want.cpu())
