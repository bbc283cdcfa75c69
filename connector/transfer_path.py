"""How a worker's chunks move between vLLM's KV and the sidecar, per session.

Why a module of its own: there are two ways (see ``transfer_mode``), and
which one a session uses is known when vLLM registers its KV caches. The
worker then holds one :class:`TransferPath` and calls it; it compares no
mode afterwards.

* :class:`HostPath`: the connector copies. Loads lease the chunks in the
  shared arena (:class:`~.leased_reads.LeasedReads`) and hand their bytes to
  the caller's ``copy_in``; saves take write slots, gather the blocks into
  them and commit.
* :class:`IpcPath`: the sidecar copies, between its arena and the KV
  tensors registered with it, told block ids only (LOAD_BLOCKS,
  SAVE_BLOCKS). Partial chunks are not copied that way. While the sidecar
  does not grant ipc mode to the session (it refused the registration, or
  a restarted sidecar serves host mode only), it moves chunks as
  :class:`HostPath` does: whether it grants it is the client's to say
  (:attr:`~SidecarClient.ipc_granted`, known at each HELLO).

A load answers, per request, how many of its leading chunks were copied
(or, with asynchronous device copies, are being copied); leases of a host
load stay held until :meth:`TransferPath.release_loaded`, after the copies.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from kvstrata.connector import ipc
from kvstrata.connector.arena_view import ArenaView, slot_fits
from kvstrata.connector.lease_clock import WRITE_SHARE, still_pinned
from kvstrata.connector.leased_reads import STEP_OWNER, LeasedReads, Sources

if TYPE_CHECKING:
    from kvstrata.connector.client import SidecarClient
    from kvstrata.connector.device import DeviceCopies
    from kvstrata.connector.layout import ChunkLayout
    from kvstrata.connector.metadata import ChunkKeys, ChunkTransfer, RequestTransfer
    from kvstrata.sidecar import protocol as p

__all__ = ["HostPath", "IpcPath", "Saved", "TransferPath"]

logger = logging.getLogger(__name__)

CopyIn = Callable[[Sources], None]


@dataclass(slots=True)
class Saved:
    """What became of the chunks of one save call."""

    saved: int = 0
    skipped: int = 0  # already stored, or no arena space
    dropped: int = 0  # sidecar unavailable, copy failed, or too late to copy (lease_clock)


class TransferPath(Protocol):
    """One session's way of moving chunks (module docstring)."""

    client: SidecarClient
    keys: ChunkKeys
    layouts: tuple[ChunkLayout, ...]
    copies: DeviceCopies
    arena: ArenaView
    # The sidecar may copy into vLLM's KV: a load must let it wait for vLLM's
    # queued work through an interprocess event.
    sidecar_copies: bool

    def load(
        self,
        reqs: Sequence[RequestTransfer],
        deadline: float,
        copy_in: CopyIn,
        after_event: bytes | None = None,
    ) -> list[int]: ...

    def loads_held(self) -> bool: ...

    def release_loaded(self) -> None: ...

    def save(
        self, chunks: list[ChunkTransfer], layout: ChunkLayout, blocks: int = 0, tenant: str = ""
    ) -> Saved: ...

    def saves_partial_chunks(self) -> bool: ...

    def for_session(self, client: SidecarClient, copies: DeviceCopies) -> TransferPath: ...

    def close(self) -> None: ...


class HostPath:
    """The connector copies through the shared arena (module docstring)."""

    sidecar_copies = False

    def __init__(
        self,
        client: SidecarClient,
        keys: ChunkKeys,
        layouts: tuple[ChunkLayout, ...],
        copies: DeviceCopies,
    ) -> None:
        self.client = client
        self.keys = keys
        self.layouts = layouts
        self.copies = copies  # registers the arena view with the device (CUDA)
        self.arena = ArenaView(client, copies)
        self.reads = LeasedReads(client, keys, self.arena, layouts)

    def load(
        self,
        reqs: Sequence[RequestTransfer],
        deadline: float,
        copy_in: CopyIn,
        after_event: bytes | None = None,
    ) -> list[int]:
        """Lease ``reqs``' chunks and hand their arena bytes to ``copy_in``;
        the leases stay held for :meth:`release_loaded`."""
        return self.reads.load(reqs, deadline, copy_in)

    def loads_held(self) -> bool:
        return bool(self.reads.held)

    def release_loaded(self) -> None:
        """Give back the leases of loads whose copies have finished."""
        self.reads.release_held()

    def saves_partial_chunks(self) -> bool:
        return True

    def save(
        self, chunks: list[ChunkTransfer], layout: ChunkLayout, blocks: int = 0, tenant: str = ""
    ) -> Saved:
        """Chunks of one KV cache group and one ``tenant``, all of ``blocks``
        blocks (0: full chunks), in one PREPARE_STORE + COMMIT_STORE."""
        out = Saved()
        nbytes = layout.partial_nbytes(blocks) if blocks else layout.chunk_nbytes
        shape = layout.partial_shape(blocks) if blocks else layout.chunk_shape
        asked_at = time.monotonic()  # no lease of this save started earlier
        slots = self.client.prepare_store(
            [self.keys.of(c) for c in chunks],
            nbytes,
            layout.dtype_str,
            shape,
            owner=STEP_OWNER,
            blocks=blocks,
            covers=self.keys.covered(chunks),
            tenant=tenant,
            store_tiers=chunks[0].store_tiers if chunks else None,  # one choice per batch
        )
        if slots is None:
            out.dropped += len(chunks)
            return out
        epoch = self.client.epoch  # the session that granted the slots
        arena = self.arena.tensor()
        lease_ids: list[int] = []
        ok: list[bool] = []
        late = 0
        for chunk, slot in zip(chunks, slots, strict=False):
            if slot is None:
                out.skipped += 1
                continue
            good = arena is not None and slot_fits(slot, layout, blocks)
            if good and not still_pinned(self.client, asked_at, epoch, WRITE_SHARE):
                # Too late to start: the copy could land after the slot went to
                # another chunk (lease_clock). Aborted, the chunk is a miss later.
                late += 1
                good = False
            if good and arena is not None:
                try:
                    with self.copies.saving():
                        layout.gather(
                            chunk.block_ids, arena[slot.offset : slot.offset + slot.length]
                        )
                except (RuntimeError, IndexError, ValueError):
                    logger.exception("kvstrata: copy into slot %d failed", slot.lease_id)
                    good = False
            lease_ids.append(slot.lease_id)
            ok.append(good)
        out.dropped += late
        if not lease_ids:
            return out
        if self.client.commit_store(lease_ids, ok):
            out.saved += sum(ok)
        else:
            out.dropped += len(lease_ids) - late  # the late ones are counted already
        return out

    def for_session(self, client: SidecarClient, copies: DeviceCopies) -> HostPath:
        """The same path for another session of this worker (its own copies)."""
        return HostPath(client, self.keys, self.layouts, copies)

    def close(self) -> None:
        """Drop the arena view and the device copies (the client is the caller's)."""
        self.arena.forget()
        self.copies.close()


class IpcPath:
    """The sidecar copies, told block ids; as ``host`` while it does not
    grant ipc mode to the session (module docstring). ``registration``: the
    KV handles the client registered (resent at every HELLO)."""

    sidecar_copies = True

    def __init__(self, host: HostPath, registration: p.RegisterKVRequest) -> None:
        self.host = host
        self.registration = registration
        self.client = host.client
        self.keys = host.keys
        self.layouts = host.layouts
        self.copies = host.copies
        self.arena = host.arena

    def load(
        self,
        reqs: Sequence[RequestTransfer],
        deadline: float,
        copy_in: CopyIn,
        after_event: bytes | None = None,
    ) -> list[int]:
        """One LOAD_BLOCKS (done when it answers); its copies wait for
        ``after_event`` (see :func:`~.ipc.load_requests`)."""
        if not self.client.ipc_granted:
            return self.host.load(reqs, deadline, copy_in, after_event)
        return ipc.load_requests(self.client, self.keys.of, reqs, after_event)

    def loads_held(self) -> bool:
        return self.host.loads_held()

    def release_loaded(self) -> None:
        self.host.release_loaded()

    def saves_partial_chunks(self) -> bool:
        return not self.client.ipc_granted

    def save(
        self, chunks: list[ChunkTransfer], layout: ChunkLayout, blocks: int = 0, tenant: str = ""
    ) -> Saved:
        """One SAVE_BLOCKS, after vLLM's queued work (an interprocess event)."""
        if not self.client.ipc_granted or any(c.store_tiers is not None for c in chunks):
            # SAVE_BLOCKS takes no store tiers: a request that chose them saves
            # through the arena, so that its choice is kept.
            return self.host.save(chunks, layout, blocks, tenant)
        event, handle = ipc.compute_done_event()
        committed = self.client.ipc.save_blocks(
            [self.keys.of(c) for c in chunks],
            [c.block_ids for c in chunks],
            handle,
            STEP_OWNER,
            tenant=tenant,
        )
        del event  # the sidecar has waited for it
        if committed is None:
            return Saved(dropped=len(chunks))
        return Saved(saved=sum(committed), skipped=len(committed) - sum(committed))

    def for_session(self, client: SidecarClient, copies: DeviceCopies) -> TransferPath:
        """The path for another session of this worker: ipc too (the KV
        registered on it as well) while the sidecar grants ipc to ours."""
        host = self.host.for_session(client, copies)
        if not self.client.ipc_granted:
            return host
        client.register_kv(self.registration)
        return IpcPath(host, self.registration)

    def close(self) -> None:
        self.host.close()
