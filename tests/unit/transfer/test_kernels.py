"""The csrc host library (the CUDA kernels' index code with memcpy) against torch references.

Every vLLM KV layout x every KV dtype, as CPU tensors with the GPU layouts'
shapes and strides (kvstrata.testing.kvlayouts); the expected bytes come
from kvstrata.testing.chunkref (torch indexing with hand-written page orders),
never from the plan the library copies by.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvstrata.sidecar.transfer.kernel_binding import TransferLibrary
from kvstrata.sidecar.transfer.kernels import load_host
from kvstrata.sidecar.transfer.plan import CopyPlan, TensorGeometry, plan_from_geometry
from kvstrata.testing import chunkref
from kvstrata.testing.chunkref import POISON, ChunkArena, random_block_ids
from kvstrata.testing.kvlayouts import (
    DTYPES,
    KVLayoutCase,
)

BUILDERS = chunkref.layout_builders()
DTYPE_IDS = [str(d).removeprefix("torch.") for d in DTYPES]

layouts = pytest.mark.parametrize("layout", list(BUILDERS))
dtypes = pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
coalesce = pytest.mark.parametrize("coalesced", [False, True], ids=["plan", "coalesced"])


@pytest.fixture(scope="module")
def lib() -> TransferLibrary:
    return load_host()


def plan_of(case: KVLayoutCase, coalesced: bool) -> CopyPlan:
    layers = [TensorGeometry.of(t) for t in case.layers.values()]
    plan = plan_from_geometry(layers, case.block_dim)
    return plan.coalesced() if coalesced else plan


# Three chunks of four blocks; chunk 0 and chunk 1 skip their leading block (a
# load after vLLM's prefix cache), chunk 2 skips one in the middle.
CHUNKS, PER_CHUNK, SKIP = 3, 4, (0, 4, 10)


@layouts
@dtypes
@coalesce
def test_gather_writes_every_chunk_in_chunk_order_and_no_other_byte(
    lib: TransferLibrary, layout: str, dtype: torch.dtype, coalesced: bool
) -> None:
    case = BUILDERS[layout](dtype=dtype, seed=1)
    plan = plan_of(case, coalesced)
    ids = random_block_ids(case.num_blocks, CHUNKS * PER_CHUNK, seed=2, skip=SKIP)
    arena = ChunkArena(CHUNKS, plan.chunk_nbytes(PER_CHUNK))
    before = [s.clone() for s in chunkref.storage_bytes(list(case.layers.values()))]

    lib.gather(plan, ids, arena.addresses, PER_CHUNK)

    chunks = [
        chunkref.chunk_bytes(case, ids[c * PER_CHUNK : (c + 1) * PER_CHUNK], POISON)
        for c in range(CHUNKS)
    ]
    assert torch.equal(arena.buf, arena.expected_after_gather(chunks))
    for after, old in zip(chunkref.storage_bytes(list(case.layers.values())), before, strict=True):
        assert torch.equal(after, old)  # a gather never writes the pages


@layouts
@dtypes
@coalesce
def test_scatter_writes_the_named_blocks_and_no_other_byte(
    lib: TransferLibrary, layout: str, dtype: torch.dtype, coalesced: bool
) -> None:
    source = BUILDERS[layout](dtype=dtype, seed=3)
    target = BUILDERS[layout](dtype=dtype, seed=4)
    plan = plan_of(target, coalesced)
    src_ids = random_block_ids(source.num_blocks, CHUNKS * PER_CHUNK, seed=5)
    dst_ids = random_block_ids(target.num_blocks, CHUNKS * PER_CHUNK, seed=6, skip=SKIP)
    arena = ChunkArena(CHUNKS, plan.chunk_nbytes(PER_CHUNK), seed=7)
    chunks = [
        chunkref.chunk_bytes(source, src_ids[c * PER_CHUNK : (c + 1) * PER_CHUNK], POISON)
        for c in range(CHUNKS)
    ]
    for c, data in enumerate(chunks):
        arena.chunk(c).copy_(data)
    arena_before = arena.buf.clone()
    expected = chunkref.clone_layers(list(target.layers.values()))
    for c, data in enumerate(chunks):
        chunkref.scatter_reference(
            target, expected, dst_ids[c * PER_CHUNK : (c + 1) * PER_CHUNK], data
        )

    lib.scatter(plan, dst_ids, arena.addresses, PER_CHUNK)

    got = chunkref.storage_bytes(list(target.layers.values()))
    for g, e in zip(got, chunkref.storage_bytes(expected), strict=True):
        assert torch.equal(g, e)  # named blocks written, skipped ones and padding untouched
    assert torch.equal(arena.buf, arena_before)


@layouts
@dtypes
def test_a_gathered_batch_scatters_into_other_blocks_byte_for_byte(
    lib: TransferLibrary, layout: str, dtype: torch.dtype
) -> None:
    case = BUILDERS[layout](dtype=dtype, seed=8)
    plan = plan_of(case, coalesced=True)
    perm = torch.randperm(case.num_blocks, generator=torch.Generator().manual_seed(9)).tolist()
    src, dst = perm[:6], perm[6:]
    arena = ChunkArena(2, plan.chunk_nbytes(3))
    layers = list(case.layers.values())
    before = chunkref.clone_layers(layers)

    lib.gather(plan, src, arena.addresses, 3)
    lib.scatter(plan, dst, arena.addresses, 3)

    for layer, old in zip(layers, before, strict=True):
        for s, d in zip(src, dst, strict=True):
            moved = layer.select(case.block_dim, d).contiguous().view(torch.uint8)
            assert torch.equal(moved, old.select(case.block_dim, s).contiguous().view(torch.uint8))


# ---- access width: odd sizes and unaligned addresses still copy exactly ----------------


def reference_gather(
    pages: np.ndarray, base: int, plan: CopyPlan, ids: list[int], chunk: np.ndarray, chunk_base: int
) -> np.ndarray:
    """The byte model of plan.py written out with numpy slices (one chunk)."""
    out = chunk.copy()
    layers, segments, per_chunk, n = (
        plan.num_layers,
        plan.num_segments,
        len(ids),
        plan.segment_bytes,
    )
    for p, b in enumerate(ids):
        for layer, address in enumerate(plan.layer_addresses):
            for s in range(segments):
                at = address - base + b * plan.block_stride + s * plan.segment_stride
                if plan.block_outer:
                    k = (p * layers + layer) * segments + s
                else:
                    k = (layer * per_chunk + p) * segments + s
                out[chunk_base + k * n : chunk_base + (k + 1) * n] = pages[at : at + n]
    return out


# (layer offset, chunk offset, block stride, segment stride, segment bytes, segments,
#  block-outer, expected width)
WIDTH_CASES = {
    "all-16-aligned": (0, 0, 4096, 1024, 512, 3, False, 16),
    "segment-8-aligned": (0, 0, 4096, 1024, 520, 3, False, 8),
    "segment-4-aligned": (0, 0, 4096, 1024, 516, 3, False, 4),
    "segment-2-aligned": (0, 0, 4096, 1024, 514, 3, False, 2),
    "segment-odd": (0, 0, 4096, 1024, 37, 3, True, 1),
    "layer-address-8": (8, 0, 4096, 1024, 512, 3, False, 8),
    "chunk-address-4": (0, 4, 4096, 1024, 512, 3, False, 4),
    "layer-address-1": (1, 0, 4096, 1024, 512, 3, True, 1),
    "block-stride-8": (0, 0, 4104, 1024, 512, 3, False, 8),
    "segment-stride-4": (0, 0, 4096, 1028, 512, 3, False, 4),
    "long-units-16": (0, 0, 3 * 16384 + 64, 0, 3 * 16384 + 48, 1, False, 16),
    "long-units-2": (0, 0, 40008, 0, 40002, 1, False, 2),
    "long-units-1": (3, 0, 5008, 0, 5001, 1, True, 1),
}


@pytest.mark.parametrize("spec", list(WIDTH_CASES.values()), ids=list(WIDTH_CASES))
def test_odd_sizes_and_unaligned_addresses_pick_a_narrower_access_and_copy_exactly(
    lib: TransferLibrary, spec: tuple
) -> None:
    layer_off, chunk_off, block_stride, seg_stride, seg_bytes, segments, outer, width = spec
    num_layers, num_blocks, per_chunk = 2, 5, 3
    layer_span = num_blocks * block_stride + 64
    rng = np.random.default_rng(11)
    pages = rng.integers(0, 256, size=16 + num_layers * layer_span, dtype=np.uint8)
    base = pages.ctypes.data
    pad = (-base) % 16  # start from a 16-byte boundary, then add the case's offset
    layer_addresses = tuple(base + pad + layer_off + i * layer_span for i in range(num_layers))
    plan = CopyPlan(
        layer_addresses, num_blocks, block_stride, segments, seg_stride, seg_bytes, outer
    )
    chunk_nbytes = plan.chunk_nbytes(per_chunk)
    chunk = np.full(chunk_nbytes + 64, POISON, dtype=np.uint8)
    chunk_base = (-chunk.ctypes.data) % 16 + chunk_off
    chunk_address = chunk.ctypes.data + chunk_base
    ids = [3, 0, 4]

    assert lib.vector_width(plan, [chunk_address]) == width
    expected = reference_gather(pages, base, plan, ids, chunk, chunk_base)
    lib.gather(plan, ids, [chunk_address], per_chunk)
    assert np.array_equal(chunk, expected)

    pages_before = pages.copy()
    lib.scatter(plan, [1, -1, 2], [chunk_address], per_chunk)
    # Block 1 now holds what block 3 held, block 2 what block 4 held; nothing else moved.
    moved = pages_before.copy()
    for a in layer_addresses:
        for s in range(segments):
            for src, dst in ((3, 1), (4, 2)):
                to = a - base + dst * block_stride + s * seg_stride
                at = a - base + src * block_stride + s * seg_stride
                moved[to : to + seg_bytes] = pages_before[at : at + seg_bytes]
    assert np.array_equal(pages, moved)


# ---- input validation: refused before anything is copied ----------------------------------


def small_plan(pages: np.ndarray) -> CopyPlan:
    return CopyPlan((pages.ctypes.data,), num_blocks=4, block_stride=64, num_segments=1,
                    segment_stride=0, segment_bytes=64)  # fmt: skip


BAD_CALLS = {
    "block id past the last block": (dict(block_ids=[0, 4]), "block id 4 >= num_blocks 4"),
    "too few block ids": (dict(block_ids=[0]), "1 block ids for 1 chunks of 2 blocks"),
    "float block ids": (dict(block_ids=[0.0, 1.5]), "block_ids must be integers"),
    "nested block ids": (dict(block_ids=[[0, 1]]), "one-dimensional"),
    "null chunk address": (dict(chunk_addresses=[0]), "chunk_addresses: 0 is outside"),
    "negative chunk address": (dict(chunk_addresses=[-8]), "chunk_addresses: -8 is outside"),
    "no blocks per chunk": (dict(blocks_per_chunk=0), "blocks_per_chunk must be >= 1"),
    "negative stream": (dict(stream=-1), "stream must be a cudaStream_t"),
    "negative max_ctas": (dict(max_ctas=-1), "max_ctas must be >= 0"),
}


@pytest.mark.parametrize("how", ["gather", "scatter"])
@pytest.mark.parametrize("bad", list(BAD_CALLS.values()), ids=list(BAD_CALLS))
def test_bad_input_is_refused_with_a_value_error_before_any_byte_moves(
    lib: TransferLibrary, how: str, bad: tuple[dict, str]
) -> None:
    overrides, message = bad
    pages = np.arange(4 * 64, dtype=np.uint8)
    chunk = np.full(2 * 64, POISON, dtype=np.uint8)
    call = dict(block_ids=[2, 1], chunk_addresses=[chunk.ctypes.data], blocks_per_chunk=2)
    call.update(overrides)
    with pytest.raises(ValueError, match=message):
        getattr(lib, how)(small_plan(pages), **call)
    assert np.all(chunk == POISON)
    assert np.array_equal(pages, np.arange(4 * 64, dtype=np.uint8))


def test_a_plan_with_an_empty_segment_is_refused(lib: TransferLibrary) -> None:
    pages = np.zeros(256, dtype=np.uint8)
    plan = CopyPlan((pages.ctypes.data,), 4, 64, 1, 0, 0)
    with pytest.raises(ValueError, match=r"plan\.segment_bytes = 0"):
        lib.gather(plan, [0], [pages.ctypes.data], 1)


def test_numpy_block_ids_and_addresses_are_taken_as_they_are(lib: TransferLibrary) -> None:
    pages = np.arange(4 * 64, dtype=np.uint8)
    chunk = np.zeros(128, dtype=np.uint8)
    addresses = np.array([chunk.ctypes.data], dtype=np.uint64)
    lib.gather(small_plan(pages), np.array([3, 0], dtype=np.int32), addresses, 2)
    assert np.array_equal(chunk, np.concatenate([pages[192:256], pages[0:64]]))


def test_a_call_of_no_chunks_copies_nothing(lib: TransferLibrary) -> None:
    pages = np.arange(4 * 64, dtype=np.uint8)
    lib.gather(small_plan(pages), [], [], 2)
    assert np.array_equal(pages, np.arange(4 * 64, dtype=np.uint8))


def test_chunk_size_matches_the_bytes_of_the_layers_blocks() -> None:
    # The reference and the plan agree on how many bytes a chunk holds, for every layout.
    for build in BUILDERS.values():
        case = build(dtype=torch.bfloat16)
        layer = next(iter(case.layers.values()))
        per_block = math.prod(layer.shape) // case.num_blocks * layer.element_size()
        assert plan_of(case, True).chunk_nbytes(2) == 2 * per_block * len(case.layers), case.name
