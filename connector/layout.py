"""vLLM's paged KV tensors <-> the contiguous bytes of one chunk.

Why: the sidecar stores a chunk as one opaque byte string; only the
connector knows how vLLM lays its KV out. This module detects the layout
once (at ``register_kv_caches``) and refuses what it does not know, so a
new vLLM layout can never be read back as wrong bytes.

Known layout (vLLM-CPU, ``CPU_ATTN``), one tensor per attention layer::

    [num_blocks, num_kv_heads, block_size, 2 * head_dim]
    (inside a block and head: block_size K rows, then block_size V rows)

A chunk of ``B = chunk_size // block_size`` blocks is stored as::

    [num_layers, B, num_kv_heads, block_size, 2 * head_dim]   (KV dtype)

i.e. for each layer (in model order) the chunk's blocks back to back, each
block exactly as vLLM holds it. Copies are whole blocks, so gathering and
scattering are one contiguous copy per layer and run of consecutive blocks.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

# The namespace's layout string for vLLM-CPU. Changing how chunks are laid
# out must change this string, so old entries become misses, never garbage.
CPU_LAYOUT = "vllm-cpu:blocks,kv_heads,block,k+v*head_dim:v1"


class UnsupportedLayoutError(ValueError):
    """The KV tensors are not in a layout this connector can copy."""


def expected_layout(device_type: str) -> str | None:
    """The layout string for a vLLM platform, or None when unsupported.

    Both connector roles compute it from the config alone (the scheduler
    never sees the tensors), so their namespaces agree.
    """
    return CPU_LAYOUT if device_type == "cpu" else None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _layer_order(name: str) -> tuple[int, str]:
    numbers = re.findall(r"\.(\d+)\.", f".{name}.")
    return (int(numbers[0]) if numbers else -1, name)


@dataclass(frozen=True, slots=True)
class ChunkLayout:
    """How one chunk's bytes map onto the registered KV tensors."""

    layers: tuple[torch.Tensor, ...]  # in model order
    layer_names: tuple[str, ...]
    blocks_per_chunk: int
    block_shape: tuple[int, ...]  # one block of one layer
    dtype: torch.dtype

    @property
    def chunk_shape(self) -> tuple[int, ...]:
        return (len(self.layers), self.blocks_per_chunk, *self.block_shape)

    @property
    def chunk_nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.chunk_shape:
            n *= d
        return n

    @property
    def dtype_str(self) -> str:
        return dtype_name(self.dtype)

    def view(self, buf: torch.Tensor) -> torch.Tensor:
        """``buf`` (uint8, ``chunk_nbytes`` long) as the chunk-shaped tensor."""
        return buf.view(self.dtype).view(self.chunk_shape)

    def gather(self, block_ids: Sequence[int], out: torch.Tensor) -> None:
        """Copy the chunk's blocks of every layer into ``out`` (uint8 bytes)."""
        dst = self.view(out)
        for pos, start, n in _runs(block_ids):
            for i, kv in enumerate(self.layers):
                dst[i, pos : pos + n].copy_(kv[start : start + n])

    def scatter(self, src: torch.Tensor, block_ids: Sequence[int], first_block: int = 0) -> None:
        """Copy chunk bytes ``src`` into the blocks ``block_ids[first_block:]``."""
        chunk = self.view(src)
        for pos, start, n in _runs(block_ids, first_block):
            for i, kv in enumerate(self.layers):
                kv[start : start + n].copy_(chunk[i, pos : pos + n])


def _runs(block_ids: Sequence[int], first: int = 0) -> list[tuple[int, int, int]]:
    """``(position in chunk, first block id, count)`` of each run of consecutive
    block ids, so each copy is one contiguous memcpy (vLLM hands out blocks
    mostly in order; indexed copies take slow paths on CPU)."""
    runs: list[tuple[int, int, int]] = []
    for pos in range(first, len(block_ids)):
        b = int(block_ids[pos])
        if runs and runs[-1][1] + runs[-1][2] == b:
            p, start, n = runs[-1]
            runs[-1] = (p, start, n + 1)
        else:
            runs.append((pos, b, 1))
    return runs


def detect_layout(
    kv_caches: dict[str, torch.Tensor],
    *,
    layout: str | None,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    blocks_per_chunk: int,
) -> ChunkLayout:
    """Check the tensors against ``layout`` and return the copy plan.

    Raises :class:`UnsupportedLayoutError` naming what differs.
    """
    if layout != CPU_LAYOUT:
        raise UnsupportedLayoutError(f"no chunk layout for this platform (layout {layout!r})")
    if not kv_caches:
        raise UnsupportedLayoutError("no KV cache tensors were registered")
    names = sorted(kv_caches, key=_layer_order)
    first = kv_caches[names[0]]
    want = (num_kv_heads, block_size, 2 * head_dim)
    for name in names:
        kv = kv_caches[name]
        if kv.dim() != 4 or tuple(kv.shape[1:]) != want:
            raise UnsupportedLayoutError(
                f"layer {name}: KV tensor shape {tuple(kv.shape)}, expected "
                f"[num_blocks, {num_kv_heads}, {block_size}, {2 * head_dim}]"
            )
        if kv.dtype != first.dtype or kv.shape[0] != first.shape[0]:
            raise UnsupportedLayoutError(f"layer {name}: dtype or block count differs")
        if not kv.is_contiguous() or kv.device.type != "cpu":
            raise UnsupportedLayoutError(f"layer {name}: not a contiguous CPU tensor")
    return ChunkLayout(
        layers=tuple(kv_caches[n] for n in names),
        layer_names=tuple(names),
        blocks_per_chunk=blocks_per_chunk,
        block_shape=want,
        dtype=first.dtype,
    )
