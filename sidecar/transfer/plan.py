"""Where a chunk's bytes live in vLLM's paged KV tensors, read from strides.

Why: vLLM lays its KV out in many ways (per platform, backend and
version), but every layout we move has the same shape at the byte level:
for each layer and each paged block there are ``num_segments`` runs of
``segment_bytes`` contiguous bytes, ``segment_stride`` apart, the block's
first run ``block_stride`` bytes after the previous block's. A
:class:`CopyPlan` holds exactly those numbers; the torch copy
(:mod:`kvstrata.sidecar.transfer.torch_copy`) and the CUDA kernels
(``csrc/``) both move bytes by it, so they agree by construction.

The plan is built from a tensor's shape and strides, never from its shape
alone (:func:`plan_from_geometry`): the block dimension is named by the
caller; every other dimension is inside the page (stride below the block
stride) or outside it (above). The densest run of inner dimensions becomes
the segment; at most one other dimension may remain, and it becomes the
segment count. Examples (element strides, dims in logical order):

==========================================  ==========  ==============
layout                                       block dim   segments
==========================================  ==========  ==============
vLLM >= 0.32 per-layer view ``[B, H, N, C]``  0           1, or H when
(any ``KVCacheLayout``; C in bytes or dtype)              heads sit outside
                                                          the page (LHBNC)
                                                          or layers inside
                                                          it (BHLNC)
FlashAttention ``[2, B, N, H, D]`` (NHD/HND)  1           2 (K, V)
FlashInfer ``[B, 2, N, H, D]`` (NHD/HND)      0           1
MLA ``[B, N, latent]``                        0           1
vLLM-CPU (<= 0.31) ``[B, H, N, 2D]``          0           1
==========================================  ==========  ==============

Chunk byte order. A chunk of ``blocks_per_chunk`` blocks is stored as::

    layer-outer (default):  [layer][block in chunk][segment][segment_bytes]
    block-outer:            [block in chunk][layer][segment][segment_bytes]

Block-outer is used when the layers' pages of one block are interleaved
in memory (vLLM's block-outermost layouts, ``BL..``: cross-layer blocks):
then all layers of a block are one run and a chunk is ``blocks_per_chunk``
copies. :meth:`CopyPlan.coalesced` merges abutting runs (layers of one
block, segments of one page) without changing the chunk's bytes.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any


class UnsupportedLayoutError(ValueError):
    """The KV tensors are not in a layout a plan can describe."""


@dataclass(frozen=True, slots=True)
class TensorGeometry:
    """What the plan needs of one KV tensor (a layer, or all layers at once)."""

    address: int  # byte address of element [0, 0, ...] (data_ptr)
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in elements
    itemsize: int

    @classmethod
    def of(cls, tensor: Any) -> TensorGeometry:
        """The geometry of a torch tensor (torch is not imported here)."""
        return cls(
            address=int(tensor.data_ptr()),
            shape=tuple(int(d) for d in tensor.shape),
            strides=tuple(int(s) for s in tensor.stride()),
            itemsize=int(tensor.element_size()),
        )


@dataclass(frozen=True, slots=True)
class CopyPlan:
    """Byte geometry shared by every layer of one KV cache group.

    Unit ``(layer l, block b, segment s)`` lives at
    ``layer_addresses[l] + b * block_stride + s * segment_stride`` and is
    ``segment_bytes`` long. All offsets are bytes.
    """

    layer_addresses: tuple[int, ...]
    num_blocks: int
    block_stride: int
    num_segments: int
    segment_stride: int
    segment_bytes: int
    block_outer: bool = False

    @property
    def num_layers(self) -> int:
        return len(self.layer_addresses)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of all layers in a chunk."""
        return self.num_layers * self.num_segments * self.segment_bytes

    def chunk_nbytes(self, blocks_per_chunk: int) -> int:
        return blocks_per_chunk * self.block_bytes

    def chunk_shape(self, blocks_per_chunk: int, itemsize: int) -> tuple[int, ...]:
        """A chunk as an array of KV elements, in the chunk byte order: the shape
        recorded with every stored chunk, whichever mode saved it (the ipc sidecar
        and a host-mode connector both build it from their plan, and a load checks
        it against its own)."""
        outer = (
            (blocks_per_chunk, self.num_layers)
            if self.block_outer
            else (self.num_layers, blocks_per_chunk)
        )
        return (*outer, self.num_segments, self.segment_bytes // itemsize)

    def chunk_offset(self, layer: int, position: int, segment: int, blocks_per_chunk: int) -> int:
        """Byte offset of a unit inside a chunk (the order in the module docstring)."""
        if self.block_outer:
            unit = (position * self.num_layers + layer) * self.num_segments + segment
        else:
            unit = (layer * blocks_per_chunk + position) * self.num_segments + segment
        return unit * self.segment_bytes

    def source_address(self, layer: int, block_id: int, segment: int) -> int:
        base = self.layer_addresses[layer]
        return base + block_id * self.block_stride + segment * self.segment_stride

    def coalesced(self) -> CopyPlan:
        """The same bytes in fewer, longer runs.

        Segments that abut (``segment_stride == segment_bytes``) become one;
        then, in block-outer order, layers whose pages abut inside a block
        (layer ``l + 1`` starts where layer ``l``'s page ends) become one.
        """
        plan = self
        if plan.num_segments > 1 and plan.segment_stride == plan.segment_bytes:
            plan = replace(
                plan,
                num_segments=1,
                segment_stride=0,
                segment_bytes=plan.num_segments * plan.segment_bytes,
            )
        if plan.block_outer and plan.num_layers > 1 and plan.num_segments == 1:
            first = plan.layer_addresses[0]
            if all(a == first + i * plan.segment_bytes for i, a in enumerate(plan.layer_addresses)):
                plan = replace(
                    plan,
                    layer_addresses=(first,),
                    segment_bytes=plan.num_layers * plan.segment_bytes,
                )
        return plan

    def check_block_ids(self, block_ids: Iterable[int]) -> None:
        """Raise ValueError naming the first block id outside ``[0, num_blocks)``.

        Negative ids are allowed: they mean "skip this block" (see the kernels).
        """
        for b in block_ids:
            if int(b) >= self.num_blocks:
                raise ValueError(f"block id {int(b)} >= num_blocks {self.num_blocks}")


def _page_geometry(geom: TensorGeometry, block_dim: int) -> tuple[int, int, int]:
    """``(num_segments, segment_stride, segment_bytes)`` in bytes for one tensor."""
    block_stride = geom.strides[block_dim]
    dims = [
        (geom.strides[d] * geom.itemsize, geom.shape[d])
        for d in range(len(geom.shape))
        if d != block_dim and geom.shape[d] > 1
    ]
    # Innermost first: peel off the dense run that forms one segment.
    dims.sort()
    run = geom.itemsize
    rest: list[tuple[int, int]] = []
    for stride, size in dims:
        if not rest and stride == run:
            run *= size
        else:
            rest.append((stride, size))
    if run % geom.itemsize or (dims and dims[0][0] != geom.itemsize):
        raise UnsupportedLayoutError(
            f"tensor {geom.shape} strides {geom.strides}: the innermost dimension is not dense"
        )
    if len(rest) > 1:
        raise UnsupportedLayoutError(
            f"tensor {geom.shape} strides {geom.strides}: a page is split along "
            f"{len(rest)} dimensions; at most one is supported"
        )
    if not rest:
        return 1, 0, run
    seg_stride, num_segments = rest[0]
    block_stride_bytes = block_stride * geom.itemsize
    inside = seg_stride < block_stride_bytes
    # Segments must not overlap each other or (inside a page) the next block.
    if seg_stride < run or (inside and (num_segments - 1) * seg_stride + run > block_stride_bytes):
        raise UnsupportedLayoutError(
            f"tensor {geom.shape} strides {geom.strides}: overlapping page segments"
        )
    return num_segments, seg_stride, run


def plan_from_geometry(layers: list[TensorGeometry], block_dim: int) -> CopyPlan:
    """The copy plan of one KV cache group from each layer's tensor geometry.

    ``layers`` are in model order; every layer must have the same shape,
    strides and itemsize (one group). Raises :class:`UnsupportedLayoutError`
    naming what differs or what cannot be described.
    """
    if not layers:
        raise UnsupportedLayoutError("no KV cache tensors were registered")
    first = layers[0]
    if not 0 <= block_dim < len(first.shape):
        raise UnsupportedLayoutError(
            f"block dimension {block_dim} of a {len(first.shape)}-D tensor"
        )
    for i, g in enumerate(layers[1:], start=1):
        if (g.shape, g.strides, g.itemsize) != (first.shape, first.strides, first.itemsize):
            raise UnsupportedLayoutError(
                f"layer {i}: shape {g.shape} strides {g.strides} itemsize {g.itemsize} differ "
                f"from layer 0 ({first.shape}, {first.strides}, {first.itemsize})"
            )
    num_segments, seg_stride, seg_bytes = _page_geometry(first, block_dim)
    block_stride = first.strides[block_dim] * first.itemsize
    addresses = tuple(g.address for g in layers)
    # Layers interleaved inside blocks (cross-layer pages): block-outer order.
    spacing = {b - a for a, b in itertools.pairwise(addresses)}
    block_outer = len(addresses) > 1 and all(0 < s < block_stride for s in spacing)
    if block_outer:
        # Every layer's runs of one block must be distinct and inside the block.
        starts = sorted(
            a - addresses[0] + s * seg_stride for a in addresses for s in range(num_segments)
        )
        if any(b - a < seg_bytes for a, b in itertools.pairwise(starts)) or (
            starts[-1] + seg_bytes > block_stride
        ):
            raise UnsupportedLayoutError("layer pages interleaved in a block overlap each other")
    return CopyPlan(
        layer_addresses=addresses,
        num_blocks=first.shape[block_dim],
        block_stride=block_stride,
        num_segments=num_segments,
        segment_stride=seg_stride,
        segment_bytes=seg_bytes,
        block_outer=block_outer,
    )


def per_manager_block(plan: CopyPlan, num_blocks: int) -> CopyPlan:
    """A plan over the tensors' kernel blocks as one over vLLM's ``num_blocks``
    (larger) blocks, whose ids the workers send.

    vLLM's attention kernels may split each of its cache blocks into several
    smaller ones (kernel block size < block size): the tensors then have
    ``ratio`` times more blocks, and vLLM's block ``b`` is kernel blocks
    ``b * ratio .. b * ratio + ratio - 1``. That is one run when a page is
    dense (one segment filling the block stride); otherwise refused.
    """
    if plan.num_blocks == num_blocks:
        return plan
    ratio, rest = divmod(plan.num_blocks, num_blocks) if num_blocks > 0 else (0, 1)
    dense = plan.num_segments == 1 and plan.segment_bytes == plan.block_stride
    if rest or not ratio or not dense:
        raise UnsupportedLayoutError(
            f"{plan.num_blocks} kernel blocks for {num_blocks} cache blocks"
            + ("" if dense else " in a layout whose pages are not dense")
        )
    return replace(
        plan,
        num_blocks=num_blocks,
        block_stride=plan.block_stride * ratio,
        segment_bytes=plan.segment_bytes * ratio,
    )
