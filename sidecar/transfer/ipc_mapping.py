"""One session's registered KV as the sidecar maps it, and the checks every copy makes against it.

Why a module of its own: an :class:`IpcMapping` is what SAVE_BLOCKS and
LOAD_BLOCKS run on (the device, the opened allocations, the copy plan, the
chunk's dtype and shape) and what the session table of
:class:`~kvstrata.sidecar.transfer.ipc.IpcTransfers` keeps and closes; the
block ids a client names are checked against it here, before any kernel
trusts them.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from kvstrata.sidecar import protocol as p
from kvstrata.sidecar.objformat import ChunkMeta
from kvstrata.sidecar.transfer.ipc_device import TransferDevice
from kvstrata.sidecar.transfer.plan import CopyPlan

__all__ = ["IpcMapping", "past"]


@dataclass(slots=True)
class IpcMapping:
    """One worker's registered KV, as mapped in the sidecar."""

    device: TransferDevice
    opened: list[int]  # device addresses of the opened allocations (to close)
    plan: CopyPlan
    blocks_per_chunk: int
    meta: ChunkMeta  # dtype and shape recorded with every chunk saved
    copies: int = 0  # copies running on it now (its handles stay open until 0)
    closing: threading.Event = field(default_factory=threading.Event)  # a waiting copy gives up
    detached: bool = False  # out of the table: the last copy to end closes the handles

    @property
    def chunk_nbytes(self) -> int:
        return self.plan.chunk_nbytes(self.blocks_per_chunk)

    def check_blocks(self, block_ids: list[list[int]], *, save: bool = False) -> None:
        """Refuse a wrong block count or a block past the KV (the kernels trust
        ids), and for a save a skipped block (-1): its bytes in the slot would
        never be written, and such a slot must never be committed."""
        for i, ids in enumerate(block_ids):
            if len(ids) != self.blocks_per_chunk:
                raise p.ProtocolError(
                    p.E_BAD_REQUEST,
                    f"field 'block_ids[{i}]': {len(ids)} blocks, a chunk has "
                    f"{self.blocks_per_chunk}",
                )
            for b in ids:
                if save and b < 0:
                    raise p.ProtocolError(
                        p.E_BAD_REQUEST,
                        f"field 'block_ids[{i}]': a save names every block of a chunk (no -1)",
                    )
                if b >= self.plan.num_blocks:
                    raise p.ProtocolError(
                        p.E_BAD_REQUEST,
                        f"field 'block_ids[{i}]': block {b} >= {self.plan.num_blocks}",
                    )


def past(expires: float | None) -> bool:
    """Whether a client's deadline (``time.perf_counter()``; None: none) has passed."""
    return expires is not None and time.perf_counter() >= expires
