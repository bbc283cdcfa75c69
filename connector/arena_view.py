"""A client's mapped arena as one tensor, and whether a slot in it holds a chunk.

Why a module of its own: loads read from the arena and saves write into
it, each through the slots the sidecar handed out, and both need the same
view of it. A client's slots are byte ranges of the arena *it* mapped: the
view here is re-made whenever the client's :attr:`~SidecarClient.epoch`
changes (a sidecar restart re-maps the arena; slots of an older epoch are
void), and registered with the device copies (pinned for DMA on CUDA).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvstrata.connector.client import SidecarClient
    from kvstrata.connector.client_arena import ArenaSlot
    from kvstrata.connector.device import DeviceCopies
    from kvstrata.connector.layout import ChunkLayout

__all__ = ["ArenaView", "slot_fits"]


class ArenaView:
    """``client``'s arena as one uint8 tensor, registered with ``copies``."""

    def __init__(self, client: SidecarClient, copies: DeviceCopies) -> None:
        self.client = client
        self.copies = copies
        self._view: torch.Tensor | None = None
        self._epoch = -1

    def tensor(self) -> torch.Tensor | None:
        """The arena for the client's current epoch; None while it has none."""
        epoch = self.client.epoch
        if self._view is None or epoch != self._epoch:
            self.copies.unregister_arena()
            self._view = None
            view = self.client.arena
            if view is None:
                return None
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a writable view over shared memory
                self._view = torch.frombuffer(view, dtype=torch.uint8)
            self._epoch = epoch
            self.copies.register_arena(self._view)
        return self._view

    def forget(self) -> None:
        """Drop the view and its registration with the device."""
        self.copies.unregister_arena()
        self._view = None


def slot_fits(slot: ArenaSlot, layout: ChunkLayout | None, blocks: int = 0) -> bool:
    """Whether ``slot`` holds a chunk of ``layout`` (of ``blocks`` blocks for a
    partial chunk, 0 for a full one)."""
    if layout is None:
        return False
    nbytes = layout.partial_nbytes(blocks) if blocks else layout.chunk_nbytes
    shape = layout.partial_shape(blocks) if blocks else layout.chunk_shape
    return (
        slot.length == nbytes
        and slot.dtype == layout.dtype_str
        and tuple(slot.shape) == shape
        and slot.offset % layout.dtype.itemsize == 0
    )
