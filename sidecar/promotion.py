"""Promotion: a chunk found in L2 or the shared tier is copied up into L1.

Why its own module: it is the one path that moves bytes into the arena from
below (L2 reads straight into the reserved slot; a shared-tier object is
copied in), with its own protocol against concurrent readers: the entry is
reserved ``promoting`` under the engine's lock, filled without it, then
published with a read lease for the caller, and everyone waiting on the
engine's condition for that key is woken. A failed read aborts the entry (a
miss, counted); an entry removed meanwhile is dropped at its last pin.

:class:`Promotion` is a part of :class:`~kvstrata.sidecar.engine.StorageManager`
(its base class): it uses the engine's lock, index, arena buffer, tiers and
write-behind, and never holds the lock during I/O.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from kvstrata.sidecar.keys import ChunkKey
from kvstrata.sidecar.l1 import Entry, L1Store
from kvstrata.sidecar.leases import Slot
from kvstrata.sidecar.objformat import ChunkMeta

if TYPE_CHECKING:
    from kvstrata.sidecar.tiers.base import Tier
    from kvstrata.sidecar.tiers.disk import DiskTier
    from kvstrata.sidecar.writeback import WriteBehind

__all__ = ["Promotion"]

logger = logging.getLogger(__name__)


class Promotion:
    """The engine's promotion half (module docstring)."""

    # Provided by the engine.
    _lock: threading.Lock
    _cond: threading.Condition
    _store: L1Store
    _buf: memoryview
    _wb: WriteBehind
    l2: DiskTier | None
    shared: Tier | None

    def _count(self, name: str, n: int = 1) -> None:
        raise NotImplementedError

    def _acquire_local(self, key: ChunkKey, owner: str, prefetch: bool = False) -> Slot | None:
        raise NotImplementedError

    def _read_lease(self, entry: Entry, owner: str, prefetch: bool = False) -> Slot:
        raise NotImplementedError

    def _abort_entry(self, entry: Entry) -> None:
        raise NotImplementedError

    def _promote(self, key: ChunkKey, owner: str, prefetch: bool = False) -> Slot | None:
        """``prefetch``: the read lease handed back is a prefetch's (counted apart)."""
        if self.l2 is not None:
            slot = self._promote_from_l2(key, owner, prefetch)
            if slot is not None:
                return slot
        if self.shared is not None:
            return self._promote_from_shared(key, owner, prefetch)
        return None

    def _reserve_promotion(
        self, key: ChunkKey, nbytes: int, meta: ChunkMeta, owner: str, prefetch: bool
    ) -> tuple[Entry | None, Slot | None]:
        """(entry to fill, None) or (None, a read lease when it appeared meanwhile)."""
        with self._lock:
            entry = self._store.reserve(key, nbytes, meta, read_now=True)
            if entry is not None:
                entry.promoting = True
                return entry, None
            slot = self._acquire_local(key, owner, prefetch)
        self._wb.submit()
        return None, slot

    def _finish_promotion(
        self, entry: Entry, meta: ChunkMeta, owner: str, tier: str, prefetch: bool
    ) -> Slot | None:
        with self._lock:
            entry.promoting = False
            self._cond.notify_all()
            if tier != "l2":
                self._wb.note_shared(entry.key)
            if entry.dead:
                self._store.unpin(entry)
                return None
            entry.meta = meta
            self._store.publish(entry)
            self._count(f"promotions_total_{tier}")
            self._wb.promoted(entry, tier)
            slot = self._read_lease(entry, owner, prefetch)
            self._store.unpin(entry)  # the fill pin; the read lease keeps its own
        self._wb.submit()
        return slot

    def _promote_from_l2(self, key: ChunkKey, owner: str, prefetch: bool) -> Slot | None:
        if self.l2 is None:
            return None
        info = self.l2.peek(key)
        if info is None:
            return None
        entry, slot = self._reserve_promotion(key, info.payload_bytes, info.meta, owner, prefetch)
        if entry is None:
            return slot
        view = self._buf[entry.offset : entry.offset + entry.length]
        try:
            meta = self.l2.read_into(key, view)
        except Exception:
            logger.exception("L2 read of a chunk failed")
            meta = None
        if meta is None:
            with self._lock:
                self._count("promotion_failed_total")
                self._abort_entry(entry)
            return None
        return self._finish_promotion(entry, meta, owner, "l2", prefetch)

    def _promote_from_shared(self, key: ChunkKey, owner: str, prefetch: bool) -> Slot | None:
        if self.shared is None:
            return None
        try:
            obj = self.shared.get(key)
        except Exception:  # a tier must not raise; a failure is a miss
            logger.exception("shared tier %s raised from get", self.shared.name)
            obj = None
        if obj is None:
            return None
        payload = memoryview(obj.payload).cast("B")
        entry, slot = self._reserve_promotion(key, len(payload), obj.meta, owner, prefetch)
        if entry is None:
            return slot
        self._buf[entry.offset : entry.offset + entry.length] = payload
        return self._finish_promotion(entry, obj.meta, owner, self.shared.name, prefetch)
