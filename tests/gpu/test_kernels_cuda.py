"""The CUDA transfer kernels on a real GPU, byte for byte against torch references.

Every vLLM KV layout x every KV dtype, as CUDA tensors with vLLM's shapes and
strides; chunks in device memory (a staging buffer) and in pinned host memory
the GPU writes and reads over PCIe (zero-copy). Expected bytes come from
kvstrata.testing.chunkref (torch indexing), never from the plan the kernels
copy by. Skipped where torch sees no CUDA device.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvstrata.sidecar.transfer.kernel_binding import TransferLibrary
from kvstrata.sidecar.transfer.kernels import cuda_unavailable_reason, load_cuda
from kvstrata.sidecar.transfer.plan import CopyPlan, TensorGeometry, plan_from_geometry
from kvstrata.testing import chunkref
from kvstrata.testing.chunkref import POISON, ChunkArena, random_block_ids
from kvstrata.testing.kvlayouts import (
    DTYPES,
    KVLayoutCase,
    flash_attn_layers,
    vllm_layers,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]

BUILDERS = chunkref.layout_builders()
DTYPE_IDS = [str(d).removeprefix("torch.") for d in DTYPES]

layouts = pytest.mark.parametrize("layout", list(BUILDERS))
dtypes = pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
chunk_memory = pytest.mark.parametrize("pinned", [False, True], ids=["device", "pinned-host"])

CHUNKS, PER_CHUNK, SKIP = 3, 4, (0, 4, 10)


@pytest.fixture(scope="module")
def lib() -> TransferLibrary:
    lib = load_cuda()
    assert lib is not None, (
        f"torch sees a GPU but the CUDA kernels do not: {cuda_unavailable_reason()}"
    )
    return lib


def plan_of(case: KVLayoutCase, coalesced: bool = True) -> CopyPlan:
    plan = plan_from_geometry([TensorGeometry.of(t) for t in case.layers.values()], case.block_dim)
    return plan.coalesced() if coalesced else plan


def arena_for(plan: CopyPlan, chunks: int, per_chunk: int, pinned: bool) -> ChunkArena:
    device = "cpu" if pinned else "cuda"
    return ChunkArena(chunks, plan.chunk_nbytes(per_chunk), device=device, pinned=pinned)


def run_on_side_stream(call: Callable[[torch.cuda.Stream], None], lib: TransferLibrary) -> None:
    """Run ``call`` on a stream of its own after all earlier work, and wait for it."""
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    call(stream)
    lib.synchronize(stream)


@layouts
@dtypes
@chunk_memory
@pytest.mark.parametrize("coalesced", [False, True], ids=["plan", "coalesced"])
def test_gather_writes_every_chunk_in_chunk_order_and_no_other_byte(
    lib: TransferLibrary, layout: str, dtype: torch.dtype, pinned: bool, coalesced: bool
) -> None:
    case = BUILDERS[layout](dtype=dtype, device="cuda", seed=1)
    plan = plan_of(case, coalesced)
    ids = random_block_ids(case.num_blocks, CHUNKS * PER_CHUNK, seed=2, skip=SKIP)
    arena = arena_for(plan, CHUNKS, PER_CHUNK, pinned)

    run_on_side_stream(lambda s: lib.gather(plan, ids, arena.addresses, PER_CHUNK, stream=s), lib)

    chunks = [
        chunkref.chunk_bytes(case, ids[c * PER_CHUNK : (c + 1) * PER_CHUNK], POISON).cpu()
        for c in range(CHUNKS)
    ]
    assert torch.equal(arena.buf.cpu(), arena.expected_after_gather(chunks).cpu())


@layouts
@dtypes
@chunk_memory
def test_scatter_writes_the_named_blocks_and_no_other_byte(
    lib: TransferLibrary, layout: str, dtype: torch.dtype, pinned: bool
) -> None:
    source = BUILDERS[layout](dtype=dtype, device="cuda", seed=3)
    target = BUILDERS[layout](dtype=dtype, device="cuda", seed=4)
    plan = plan_of(target)
    src_ids = random_block_ids(source.num_blocks, CHUNKS * PER_CHUNK, seed=5)
    dst_ids = random_block_ids(target.num_blocks, CHUNKS * PER_CHUNK, seed=6, skip=SKIP)
    arena = arena_for(plan, CHUNKS, PER_CHUNK, pinned)
    chunks = [
        chunkref.chunk_bytes(source, src_ids[c * PER_CHUNK : (c + 1) * PER_CHUNK], POISON)
        for c in range(CHUNKS)
    ]
    for c, data in enumerate(chunks):
        arena.chunk(c).copy_(data)
    expected = chunkref.clone_layers(list(target.layers.values()))
    for c, data in enumerate(chunks):
        ids = dst_ids[c * PER_CHUNK : (c + 1) * PER_CHUNK]
        chunkref.scatter_reference(target, expected, ids, data)

    run_on_side_stream(
        lambda s: lib.scatter(plan, dst_ids, arena.addresses, PER_CHUNK, stream=s), lib
    )

    got = chunkref.storage_bytes(list(target.layers.values()))
    for g, e in zip(got, chunkref.storage_bytes(expected), strict=True):
        assert torch.equal(g, e)


@chunk_memory
def test_a_batch_too_large_for_the_kernel_parameters_moves_through_device_scratch(
    lib: TransferLibrary, pinned: bool
) -> None:
    # 48 chunks of 16 blocks: 768 block ids + 48 addresses + 4 layers > 480 inline words.
    case = vllm_layers("LBNHC", num_layers=4, num_blocks=1024, device="cuda", seed=10)
    plan = plan_of(case)
    chunks, per_chunk = 48, 16
    ids = random_block_ids(case.num_blocks, chunks * per_chunk, seed=11)
    arena = arena_for(plan, chunks, per_chunk, pinned)

    run_on_side_stream(lambda s: lib.gather(plan, ids, arena.addresses, per_chunk, stream=s), lib)

    expected = [
        chunkref.chunk_bytes(case, ids[c * per_chunk : (c + 1) * per_chunk], POISON).cpu()
        for c in range(chunks)
    ]
    assert torch.equal(arena.buf.cpu(), arena.expected_after_gather(expected).cpu())


def test_cross_layer_blocks_of_a_mebibyte_move_as_one_run_per_block(lib: TransferLibrary) -> None:
    # BLNHC, 32 layers of 32 KiB pages: a coalesced plan copies 1 MiB runs.
    case = vllm_layers(
        "BLNHC", num_layers=32, num_blocks=24, heads=8, tokens=16, content=128,
        dtype=torch.bfloat16, device="cuda", seed=12,
    )  # fmt: skip
    plan = plan_of(case)
    assert plan.num_layers == 1
    assert plan.segment_bytes == 32 * 8 * 16 * 128 * 2
    ids = random_block_ids(case.num_blocks, 16, seed=13)
    arena = arena_for(plan, 2, 8, pinned=False)

    run_on_side_stream(lambda s: lib.gather(plan, ids, arena.addresses, 8, stream=s), lib)

    expected = [chunkref.chunk_bytes(case, ids[c * 8 : (c + 1) * 8], POISON) for c in range(2)]
    assert torch.equal(arena.buf, arena.expected_after_gather(expected))


def test_one_thread_block_still_copies_the_whole_batch(lib: TransferLibrary) -> None:
    case = flash_attn_layers(True, device="cuda", seed=14)
    plan = plan_of(case)
    ids = random_block_ids(case.num_blocks, 8, seed=15, skip=(0,))
    arena = arena_for(plan, 2, 4, pinned=True)

    run_on_side_stream(
        lambda s: lib.gather(plan, ids, arena.addresses, 4, stream=s, max_ctas=1), lib
    )

    expected = [chunkref.chunk_bytes(case, ids[c * 4 : (c + 1) * 4], POISON) for c in range(2)]
    assert torch.equal(arena.buf, arena.expected_after_gather([e.cpu() for e in expected]))


def test_a_gathered_batch_scatters_into_other_blocks_on_the_default_stream(
    lib: TransferLibrary,
) -> None:
    case = vllm_layers("LHBNC", dtype=torch.float8_e4m3fn, device="cuda", seed=16)
    plan = plan_of(case)
    perm = random_block_ids(case.num_blocks, 12, seed=17)
    src, dst = perm[:6], perm[6:]
    arena = arena_for(plan, 2, 3, pinned=False)
    before = chunkref.clone_layers(list(case.layers.values()))

    stream = torch.cuda.current_stream().cuda_stream
    lib.gather(plan, src, arena.addresses, 3, stream=stream)
    lib.scatter(plan, dst, arena.addresses, 3, stream=stream)
    torch.cuda.synchronize()

    for layer, old in zip(case.layers.values(), before, strict=True):
        for s, d in zip(src, dst, strict=True):
            moved = chunkref.page_bytes(case, layer, d)
            assert torch.equal(moved, chunkref.page_bytes(case, old, s))
