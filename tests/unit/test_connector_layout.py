"""Chunk layout of the vLLM connector: detection and block copies (no vLLM needed)."""

from __future__ import annotations

import re

import pytest
import torch

from kvstrata.connector.layout import CPU_LAYOUT, UnsupportedLayoutError, detect_layout

HEADS, BLOCK, HEAD_DIM, BLOCKS = 2, 32, 64, 12


def kv_caches(layers: int = 3, blocks: int = BLOCKS) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    # Names out of order on purpose: the layout sorts them by layer index.
    names = [f"model.layers.{i}.self_attn.attn" for i in (2, 0, 10, 1)[:layers]]
    return {n: torch.randn(blocks, HEADS, BLOCK, 2 * HEAD_DIM, generator=gen) for n in names}


def layout_for(caches: dict[str, torch.Tensor], layout: str | None = CPU_LAYOUT):
    return detect_layout(
        caches,
        layout=layout,
        block_size=BLOCK,
        num_kv_heads=HEADS,
        head_dim=HEAD_DIM,
        blocks_per_chunk=2,
    )


def test_layers_are_ordered_by_their_index_not_by_name() -> None:
    layout = layout_for(kv_caches(4))
    assert [n.split(".")[2] for n in layout.layer_names] == ["0", "1", "2", "10"]


def test_a_gathered_chunk_scatters_back_into_other_blocks_byte_for_byte() -> None:
    caches = kv_caches()
    layout = layout_for(caches)
    buf = torch.empty(layout.chunk_nbytes, dtype=torch.uint8)
    layout.gather([5, 2], buf)
    layout.scatter(buf, [7, 9])
    for kv in layout.layers:
        assert torch.equal(kv[7], kv[5]) and torch.equal(kv[9], kv[2])


def test_scatter_from_first_block_leaves_the_leading_blocks_alone() -> None:
    caches = kv_caches()
    layout = layout_for(caches)
    buf = torch.empty(layout.chunk_nbytes, dtype=torch.uint8)
    layout.gather([3, 4], buf)
    before = [kv[8].clone() for kv in layout.layers]
    layout.scatter(buf, [8, 11], first_block=1)
    for kv, old in zip(layout.layers, before, strict=True):
        assert torch.equal(kv[8], old)
        assert torch.equal(kv[11], kv[4])


def test_chunk_bytes_are_layer_major_whole_blocks() -> None:
    caches = kv_caches(2)
    layout = layout_for(caches)
    assert layout.chunk_shape == (2, 2, HEADS, BLOCK, 2 * HEAD_DIM)
    buf = torch.empty(layout.chunk_nbytes, dtype=torch.uint8)
    layout.gather([1, 6], buf)
    chunk = buf.view(torch.float32).view(layout.chunk_shape)
    assert torch.equal(chunk[1, 0], layout.layers[1][1])


@pytest.mark.parametrize(
    "shape",
    [
        (BLOCKS, HEADS, BLOCK, HEAD_DIM),  # K and V in separate tensors
        (BLOCKS, HEADS + 1, BLOCK, 2 * HEAD_DIM),
        (2, BLOCKS, HEADS, BLOCK, HEAD_DIM),  # a leading K/V dimension
    ],
)
def test_an_unknown_tensor_shape_is_refused_naming_the_layer(shape: tuple) -> None:
    caches = {"model.layers.0.self_attn.attn": torch.zeros(shape)}
    with pytest.raises(UnsupportedLayoutError, match=re.escape("model.layers.0")):
        layout_for(caches)


def test_a_platform_without_a_known_layout_is_refused() -> None:
    with pytest.raises(UnsupportedLayoutError, match="platform"):
        layout_for(kv_caches(), layout=None)
