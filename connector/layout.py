"""vLLM's paged KV tensors <-> the contiguous bytes of one chunk.

Why: the sidecar stores a chunk as one opaque byte string; only the
connector knows how vLLM lays its KV out. This module names the layout
from vLLM's config (both roles, so their namespaces agree), checks the
registered tensors against that name by their strides, and builds the
copy plan (:mod:`kvstrata.sidecar.transfer.plan`) that the torch copy and
the CUDA kernels move bytes by. What it cannot describe it refuses, so a
new vLLM layout can never be read back as wrong bytes.

vLLM (>= 0.32) resolves one ``KVCacheLayout`` for the whole model
(``KVCacheConfig.kv_cache_layout``: ``LBNHC``, ``LBHNC``, ``LHBNC``,
``BLNHC``, ``BLHNC``, ``BHLNC``) and hands each attention layer a logical
``[blocks, heads, tokens, content]`` view whose strides follow it: FlashAttention,
FlashInfer, Triton and MLA (one head, latent content) on GPUs, ``LBHNC``
on vLLM-CPU. Block-outermost layouts (``BL..``) keep every layer's page of
a block together (cross-layer blocks): a chunk is then one copy per block.

The namespace's layout string is ``vllm-<device>:<KVCacheLayout>:<backend>:v2``.
The device is in it because backends read the page's content differently
(vLLM-CPU keeps a head's K rows before its V rows, GPU backends K|V per
token); bytes saved under one layout string never load under another.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvstrata.sidecar.transfer import kernels
from kvstrata.sidecar.transfer.csrc_build import CSrcBuildError
from kvstrata.sidecar.transfer.kernel_binding import TransferLibrary
from kvstrata.sidecar.transfer.plan import (
    CopyPlan,
    TensorGeometry,
    UnsupportedLayoutError,
    per_manager_block,
    plan_from_geometry,
)
from kvstrata.sidecar.transfer.torch_copy import TorchCopier

if TYPE_CHECKING:
    from kvstrata.connector.leased_reads import Sources

__all__ = [
    "ChunkLayout",
    "UnsupportedLayoutError",
    "detect_layout",
    "dtype_name",
    "layout_id",
    "scatter_on_host",
]

logger = logging.getLogger(__name__)

# Bump when the chunk byte order changes: old entries become misses, never garbage.
LAYOUT_VERSION = "v2"


def _vllm_layout(kv_cache_layout: str) -> Any:
    """vLLM's own ``KVCacheLayout`` of that name: its stride order is the truth."""
    from vllm.v1.kv_cache_layout import KVCacheLayout

    try:
        return KVCacheLayout[kv_cache_layout]
    except KeyError:
        raise UnsupportedLayoutError(f"unknown vLLM KV cache layout {kv_cache_layout!r}") from None


def layout_id(device_type: str, kv_cache_layout: str | None, backend: str | None) -> str | None:
    """The namespace's layout string, or None when vLLM named no layout.

    Both connector roles compute it from the config alone (the scheduler
    never sees the tensors), so their namespaces agree.
    """
    if not kv_cache_layout:
        return None
    return f"vllm-{device_type}:{kv_cache_layout}:{backend or 'auto'}:{LAYOUT_VERSION}"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _layer_order(name: str) -> tuple[int, str]:
    numbers = re.findall(r"\.(\d+)\.", f".{name}.")
    return (int(numbers[0]) if numbers else -1, name)


@dataclass(frozen=True, slots=True)
class ChunkLayout:
    """How one chunk's bytes map onto the registered KV tensors."""

    layer_names: tuple[str, ...]  # in model order
    layers: tuple[torch.Tensor, ...]
    plan: CopyPlan  # coalesced
    copier: TorchCopier
    blocks_per_chunk: int
    dtype: torch.dtype
    block_dim: int  # the tensors' block dimension the plan was read around
    host_copies: TransferLibrary | None = None  # csrc host build, for CPU tensors

    @property
    def device(self) -> torch.device:
        return self.layers[0].device

    @property
    def chunk_shape(self) -> tuple[int, ...]:
        """The chunk in KV-dtype elements, in the plan's chunk order."""
        return self.plan.chunk_shape(self.blocks_per_chunk, self.dtype.itemsize)

    @property
    def chunk_nbytes(self) -> int:
        return self.plan.chunk_nbytes(self.blocks_per_chunk)

    def partial_shape(self, blocks: int) -> tuple[int, ...]:
        """:attr:`chunk_shape` of a partial chunk of ``blocks`` blocks."""
        return self.plan.chunk_shape(blocks, self.dtype.itemsize)

    def partial_nbytes(self, blocks: int) -> int:
        return self.plan.chunk_nbytes(blocks)

    @property
    def dtype_str(self) -> str:
        return dtype_name(self.dtype)

    def gather(self, block_ids: Sequence[int], out: torch.Tensor) -> None:
        """Copy the chunk's blocks of every layer into ``out`` (uint8 bytes);
        fewer than ``blocks_per_chunk`` of them for a partial chunk."""
        n = len(block_ids)
        if self.host_copies is not None and 0 < n <= self.blocks_per_chunk:
            self._check_buffer(out, n)
            self.host_copies.gather(self.plan, block_ids, [out.data_ptr()], n)
        else:
            self.copier.gather(block_ids, out)

    def scatter(self, src: torch.Tensor, block_ids: Sequence[int], first_block: int = 0) -> None:
        """Copy chunk bytes ``src`` into the blocks ``block_ids[first_block:]``."""
        self.scatter_many([(src, block_ids, first_block)])

    def scatter_many(self, items: Sequence[tuple[torch.Tensor, Sequence[int], int]]) -> None:
        """:meth:`scatter` for several chunks, each ``(src, block_ids, first_block)``.

        With the host library, one call per block count (a load's full chunks
        all share one): each call releases the GIL once. One call per chunk
        had the copying thread wait for the GIL after every chunk, up to a
        switch interval (5 ms) each while vLLM's engine loop ran Python: a
        background load of 16 chunks took 113 ms instead of 31 ms."""
        batches: dict[int, tuple[list[int], list[int]]] = {}
        for src, block_ids, first_block in items:
            n = len(block_ids)
            if self.host_copies is None or not 0 < n <= self.blocks_per_chunk:
                self.copier.scatter(src, block_ids, first_block)
                continue
            self._check_buffer(src, n)
            ids, addresses = batches.setdefault(n, ([], []))
            ids.extend(-1 if i < first_block else int(b) for i, b in enumerate(block_ids))
            addresses.append(src.data_ptr())
        for n, (ids, addresses) in batches.items():
            assert self.host_copies is not None  # batched only with the library
            self.host_copies.scatter(self.plan, ids, addresses, n)

    def _check_buffer(self, buf: torch.Tensor, blocks: int) -> None:
        # The library trusts addresses: make sure the chunk fits the buffer.
        nbytes = self.plan.chunk_nbytes(blocks)
        if buf.device.type != "cpu" or buf.numel() * buf.element_size() < nbytes:
            raise ValueError(f"chunk buffer {tuple(buf.shape)} cannot hold {nbytes} B")


def scatter_on_host(layouts: Sequence[ChunkLayout], work: Sources) -> None:
    """Copy a load's chunks into vLLM's KV on the CPU: one batch per KV cache
    group (:meth:`ChunkLayout.scatter_many`)."""
    for group, layout in enumerate(layouts):
        mine = [
            (src, chunk.block_ids, chunk.first_block) for chunk, src in work if chunk.group == group
        ]
        if mine:
            layout.scatter_many(mine)


def _check_view_order(name: str, kv: torch.Tensor, kv_cache_layout: str) -> None:
    # Physical order of the view's logical dims [B, H, N, C].
    order = _vllm_layout(kv_cache_layout).layer_view_order
    if kv.dim() != 4:
        raise UnsupportedLayoutError(
            f"layer {name}: a {kv.dim()}-D KV tensor {tuple(kv.shape)}, expected the "
            "[blocks, heads, tokens, content] view of vLLM's KV cache layouts"
        )
    # Dims in memory order, outermost first (size-1 dims carry no order).
    strides = kv.stride()
    actual = [d for d in sorted(range(4), key=lambda d: -strides[d]) if kv.shape[d] > 1]
    expected = [d for d in order if kv.shape[d] > 1]
    if actual != expected:
        raise UnsupportedLayoutError(
            f"layer {name}: strides {tuple(strides)} of shape {tuple(kv.shape)} do not "
            f"follow the {kv_cache_layout} layout"
        )


def _legacy_block_dim(kv: torch.Tensor, num_blocks: int | None) -> int:
    dims = [d for d, n in enumerate(kv.shape) if n == num_blocks]
    if num_blocks is None or len(dims) != 1:
        raise UnsupportedLayoutError(
            f"cannot tell the block dimension of a {tuple(kv.shape)} tensor for {num_blocks} blocks"
        )
    return dims[0]


def detect_layout(
    kv_caches: dict[str, torch.Tensor],
    *,
    kv_cache_layout: str | None,
    blocks_per_chunk: int,
    num_blocks: int | None = None,
    block_dim: int | None = None,
) -> ChunkLayout:
    """Check the tensors and return the copy plan of one chunk.

    ``kv_cache_layout`` is vLLM's resolved layout name; each tensor's strides
    must follow it. With ``None`` (tensors of another vLLM generation, and
    tests) the plan is read from the strides alone around ``block_dim``
    (default: the one dimension of ``num_blocks`` entries, e.g. 1 for
    FlashAttention's ``[2, B, N, H, D]``); vLLM's views have blocks on 0.
    ``num_blocks`` is vLLM's block count (its kernels may split blocks).
    Raises :class:`UnsupportedLayoutError` naming what differs.
    """
    if not kv_caches:
        raise UnsupportedLayoutError("no KV cache tensors were registered")
    names = sorted(kv_caches, key=_layer_order)
    tensors = [kv_caches[n] for n in names]
    first = tensors[0]
    for name, kv in zip(names, tensors, strict=True):
        if kv.dtype != first.dtype or kv.device != first.device:
            raise UnsupportedLayoutError(f"layer {name}: dtype or device differs from layer 0")
        if kv_cache_layout is not None:
            _check_view_order(name, kv, kv_cache_layout)
    if block_dim is None:
        block_dim = 0 if kv_cache_layout is not None else _legacy_block_dim(first, num_blocks)
    plan = plan_from_geometry([TensorGeometry.of(t) for t in tensors], block_dim)
    # Block-outermost layouts (BL.., BH..) interleave the layers inside each block.
    interleaved = kv_cache_layout is not None and _vllm_layout(kv_cache_layout).is_block_outermost
    if kv_cache_layout is not None and len(tensors) > 1 and plan.block_outer != interleaved:
        raise UnsupportedLayoutError(
            f"layers are {'' if plan.block_outer else 'not '}interleaved in blocks: "
            f"their strides do not follow the {kv_cache_layout} layout"
        )
    if num_blocks is not None:
        plan = per_manager_block(plan, num_blocks)
    plan = plan.coalesced()
    return ChunkLayout(
        layer_names=tuple(names),
        layers=tuple(tensors),
        plan=plan,
        copier=TorchCopier(plan, tensors),
        blocks_per_chunk=blocks_per_chunk,
        dtype=first.dtype,
        block_dim=block_dim,
        host_copies=_host_library() if first.device.type == "cpu" else None,
    )


def _host_library() -> TransferLibrary | None:
    """The csrc host build: one C loop of memcpys per chunk instead of one torch
    op per layer and run (several times faster on scattered blocks)."""
    try:
        return kernels.load_host()
    except (CSrcBuildError, OSError) as exc:
        logger.info("kvstrata: csrc host library unavailable (%s); copying with torch", exc)
        return None
