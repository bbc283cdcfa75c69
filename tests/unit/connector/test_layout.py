"""Chunk layouts of the vLLM connector: every vLLM KV layout x dtype, on CPU tensors
built with the shapes and strides vLLM uses on GPUs (no vLLM engine, no GPU needed).

The expected bytes come from plain indexing of each tensor (``tensor.select``
along its block dimension), never from the copy plan under test.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from kvstrata.connector.layout import UnsupportedLayoutError, detect_layout, layout_id
from kvstrata.testing.kvlayouts import (
    DTYPES,
    VLLM_LAYOUTS,
    KVLayoutCase,
    every_case,
    vllm_layers,
)

CASES = [case for dtype in DTYPES for case in every_case(dtype)]
POISON = 0xA5


@pytest.fixture(params=["csrc-host", "torch"])
def copies(request: pytest.FixtureRequest) -> str:
    """Both CPU copy paths: the csrc host library (the default) and the torch copier."""
    return str(request.param)


def layout_for(case: KVLayoutCase, blocks_per_chunk: int = 3, copies: str = "csrc-host"):
    layout = detect_layout(
        case.layers,
        kv_cache_layout=case.kv_cache_layout,
        blocks_per_chunk=blocks_per_chunk,
        block_dim=case.block_dim,
    )
    assert layout.host_copies is not None  # built at install (or on first use) here
    return layout if copies == "csrc-host" else dataclasses.replace(layout, host_copies=None)


def block_bytes(case: KVLayoutCase, layer: torch.Tensor, block: int) -> torch.Tensor:
    """One block of one layer as bytes, in logical order (independent reference)."""
    return layer.select(case.block_dim, block).contiguous().view(torch.uint8).flatten()


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_a_gathered_chunk_scatters_back_into_other_blocks_byte_for_byte(
    case: KVLayoutCase, copies: str
) -> None:
    layout = layout_for(case, copies=copies)
    buf = torch.full((layout.chunk_nbytes,), POISON, dtype=torch.uint8)
    layout.gather([5, 2, 3], buf)
    assert not torch.all(buf == POISON)
    before = {n: t.clone() for n, t in case.layers.items()}
    layout.scatter(buf, [7, 9, 11])
    for name, kv in case.layers.items():
        for src, dst in ((5, 7), (2, 9), (3, 11)):
            assert torch.equal(block_bytes(case, kv, dst), block_bytes(case, kv, src)), name
        # Blocks outside the scatter are untouched.
        for other in (0, 1, 4, 6, 8, 10):
            assert torch.equal(
                block_bytes(case, kv, other), block_bytes(case, before[name], other)
            ), name


@pytest.mark.parametrize("case", CASES[:12], ids=lambda c: c.name)
def test_a_chunk_holds_each_blocks_bytes_exactly_once(case: KVLayoutCase, copies: str) -> None:
    layout = layout_for(case, blocks_per_chunk=2, copies=copies)
    buf = torch.full((layout.chunk_nbytes,), POISON, dtype=torch.uint8)
    layout.gather([4, 1], buf)
    expected = sorted(
        block_bytes(case, kv, b).tolist() for kv in case.layers.values() for b in (4, 1)
    )
    assert layout.chunk_nbytes == sum(len(e) for e in expected)
    # Every byte of every selected block is in the chunk: compare multisets.
    assert sorted(buf.tolist()) == sorted(x for e in expected for x in e)


@pytest.mark.parametrize("case", CASES[:12], ids=lambda c: c.name)
def test_scatter_from_first_block_leaves_the_leading_blocks_alone(
    case: KVLayoutCase, copies: str
) -> None:
    layout = layout_for(case, blocks_per_chunk=2, copies=copies)
    buf = torch.empty(layout.chunk_nbytes, dtype=torch.uint8)
    layout.gather([3, 4], buf)
    before = [block_bytes(case, kv, 8).clone() for kv in case.layers.values()]
    layout.scatter(buf, [8, 11], first_block=1)
    for kv, old in zip(case.layers.values(), before, strict=True):
        assert torch.equal(block_bytes(case, kv, 8), old)
        assert torch.equal(block_bytes(case, kv, 11), block_bytes(case, kv, 4))


@pytest.mark.parametrize("case", CASES[:12], ids=lambda c: c.name)
def test_a_batched_scatter_lands_every_chunk_as_its_own_scatter_would(
    case: KVLayoutCase, copies: str
) -> None:
    """Full chunks, one skipping its leading block, and a partial chunk, in one call."""
    layout = layout_for(case, blocks_per_chunk=2, copies=copies)
    sources = {}
    for blocks in ([0, 1], [2, 3], [4, 5]):
        sources[tuple(blocks)] = torch.empty(layout.chunk_nbytes, dtype=torch.uint8)
        layout.gather(blocks, sources[tuple(blocks)])
    partial = torch.empty(layout.partial_nbytes(1), dtype=torch.uint8)
    layout.gather([6], partial)
    before = {n: t.clone() for n, t in case.layers.items()}
    calls = []
    if layout.host_copies is not None:
        library = layout.host_copies

        class CountingLibrary:  # the real library, its scatter calls counted
            def scatter(self, *args, **kwargs):
                calls.append(args[3])  # blocks per chunk of the batch
                return library.scatter(*args, **kwargs)

        layout = dataclasses.replace(layout, host_copies=CountingLibrary())
    layout.scatter_many(
        [
            (sources[(0, 1)], [7, 8], 0),
            (sources[(2, 3)], [9, 10], 1),  # vLLM holds block 9 already
            (sources[(4, 5)], [11, 1], 0),
            (partial, [0], 0),
        ]
    )
    for name, kv in case.layers.items():
        old = before[name]
        for src, dst in ((0, 7), (1, 8), (3, 10), (4, 11), (5, 1), (6, 0)):
            assert torch.equal(block_bytes(case, kv, dst), block_bytes(case, old, src)), name
        for untouched in (2, 3, 4, 5, 6, 9):
            assert torch.equal(
                block_bytes(case, kv, untouched), block_bytes(case, old, untouched)
            ), name
    if copies == "csrc-host":
        assert sorted(calls) == [1, 2]  # one call for the full chunks, one for the partial


def test_layers_are_ordered_by_their_index_not_by_name() -> None:
    case = vllm_layers("LBHNC", num_layers=4)
    names = list(case.layers)
    shuffled = {names[i]: case.layers[names[i]] for i in (2, 0, 3, 1)}
    renamed = {n.replace(".3.", ".10."): t for n, t in shuffled.items()}
    layout = detect_layout(renamed, kv_cache_layout="LBHNC", blocks_per_chunk=2)
    assert [n.split(".")[2] for n in layout.layer_names] == ["0", "1", "2", "10"]


def test_cross_layer_blocks_move_as_one_run_per_block() -> None:
    case = vllm_layers("BLNHC", num_layers=4)
    layout = layout_for(case)
    assert layout.plan.num_layers == 1 and layout.plan.block_outer
    assert layout.plan.segment_bytes == sum(
        block_bytes(case, kv, 0).numel() for kv in case.layers.values()
    )


@pytest.mark.parametrize("named", ["LBNHC", "LHBNC", "BLHNC"])
def test_tensors_whose_strides_disagree_with_the_named_layout_are_refused(named: str) -> None:
    case = vllm_layers("LBHNC")
    with pytest.raises(UnsupportedLayoutError, match=re.escape(f"follow the {named}")):
        detect_layout(case.layers, kv_cache_layout=named, blocks_per_chunk=2)


def test_a_tensor_of_another_rank_is_refused_naming_the_layer() -> None:
    caches = {"model.layers.0.self_attn.attn": torch.zeros(2, 12, 16, 2, 64)}
    with pytest.raises(UnsupportedLayoutError, match=re.escape("model.layers.0")):
        detect_layout(caches, kv_cache_layout="LBHNC", blocks_per_chunk=2)


def test_layers_of_different_shapes_are_refused() -> None:
    a = vllm_layers("LBHNC", num_layers=1, heads=2).layers
    b = vllm_layers("LBHNC", num_layers=1, heads=4).layers
    caches = {
        "model.layers.0.attn": next(iter(a.values())),
        "model.layers.1.attn": next(iter(b.values())),
    }
    with pytest.raises(UnsupportedLayoutError, match="layer 1"):
        detect_layout(caches, kv_cache_layout="LBHNC", blocks_per_chunk=2)


def test_kernel_blocks_smaller_than_cache_blocks_map_onto_cache_blocks() -> None:
    # vLLM may split each cache block into kernel blocks: 12 kernel blocks = 6 cache blocks.
    case = vllm_layers("LBHNC", num_blocks=12, heads=1)
    layout = detect_layout(case.layers, kv_cache_layout="LBHNC", blocks_per_chunk=1, num_blocks=6)
    buf = torch.empty(layout.chunk_nbytes, dtype=torch.uint8)
    layout.gather([2], buf)
    layout.scatter(buf, [5])
    for kv in case.layers.values():
        # Bytes, not values: random bytes hold NaNs, which never compare equal.
        assert torch.equal(kv[10:12].view(torch.uint8), kv[4:6].view(torch.uint8))


def test_every_layout_has_its_own_namespace_string() -> None:
    ids = {layout_id(device, name, None) for device in ("cpu", "cuda") for name in VLLM_LAYOUTS}
    assert len(ids) == 2 * len(VLLM_LAYOUTS)
    assert layout_id("cuda", "LBNHC", "FLASH_ATTN") != layout_id("cuda", "LBNHC", "FLASHINFER")
    assert layout_id("cuda", None, None) is None


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_the_csrc_host_library_and_the_torch_copier_write_the_same_chunk_bytes(
    case: KVLayoutCase,
) -> None:
    fast = layout_for(case, copies="csrc-host")
    slow = layout_for(case, copies="torch")
    a = torch.full((fast.chunk_nbytes,), POISON, dtype=torch.uint8)
    b = torch.full((slow.chunk_nbytes,), 0x3C, dtype=torch.uint8)
    fast.gather([6, 0, 11], a)
    slow.gather([6, 0, 11], b)
    assert torch.equal(a, b)


@pytest.mark.parametrize("case", CASES[:12], ids=lambda c: c.name)
def test_a_partial_chunk_round_trips_and_both_copy_paths_lay_it_out_alike(
    case: KVLayoutCase, copies: str
) -> None:
    layout = layout_for(case, blocks_per_chunk=3, copies=copies)
    torch_path = layout_for(case, blocks_per_chunk=3, copies="torch")
    nbytes = layout.partial_nbytes(2)
    assert nbytes * 3 == layout.chunk_nbytes * 2
    buf = torch.full((nbytes,), POISON, dtype=torch.uint8)
    layout.gather([5, 2], buf)
    ref = torch.full((nbytes,), POISON, dtype=torch.uint8)
    torch_path.gather([5, 2], ref)
    assert torch.equal(buf, ref)
    layout.scatter(buf, [9, 10])
    for kv in case.layers.values():
        assert torch.equal(block_bytes(case, kv, 9), block_bytes(case, kv, 5))
        assert torch.equal(block_bytes(case, kv, 10), block_bytes(case, kv, 2))
