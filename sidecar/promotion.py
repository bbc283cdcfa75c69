"""Promotion: a chunk found in L2 or the shared tier is copied up into L1.

Why its own module: it is the one path that moves bytes into the arena from
below (L2 and, where it can, the shared tier read straight into the
reserved slot), with its own protocol against concurrent readers: the entry is
reserved ``promoting``, filled, then published with a read lease for the
caller, and everyone waiting for that key is woken. A failed read aborts
the entry (a miss, counted); an entry removed meanwhile is dropped at its
last pin.

:class:`Promotion` does the I/O half and holds no lock: it never sees the
engine's lock or index. The steps on the index are the engine's, handed in
as :class:`IndexSteps` (three callables, each taking the engine's lock
itself): ``reserve`` the entry, ``publish`` it filled, ``fail`` it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from kvstrata.sidecar.keys import ChunkKey
from kvstrata.sidecar.l1 import Entry
from kvstrata.sidecar.leases import Slot
from kvstrata.sidecar.objformat import ChunkMeta
from kvstrata.sidecar.tierchoice import TierChoice, allows
from kvstrata.sidecar.tiers.base import Tier
from kvstrata.sidecar.tiers.disk import DiskTier

__all__ = ["IndexSteps", "Promotion"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class IndexSteps:
    """The engine's steps on its L1 index around one promotion.

    ``reserve(key, nbytes, meta, owner, prefetch)``: (entry to fill, None),
    or (None, a read lease or None) when the key appeared meanwhile or no
    space was found. ``publish(entry, meta, owner, tier, prefetch)``: the
    entry is filled from ``tier``; the caller's read lease (None when the
    entry was removed meanwhile). ``fail(entry)``: the fill failed; the
    entry is aborted and counted."""

    reserve: Callable[[ChunkKey, int, ChunkMeta, str, bool], tuple[Entry | None, Slot | None]]
    publish: Callable[[Entry, ChunkMeta, str, str, bool], Slot | None]
    fail: Callable[[Entry], None]


class Promotion:
    """Brings chunks from L2 or the shared tier into L1 (module docstring)."""

    def __init__(
        self, buf: memoryview, l2: DiskTier | None, shared: Tier | None, index: IndexSteps
    ) -> None:
        self._buf = buf  # the arena
        self.l2 = l2
        self.shared = shared
        self._index = index

    def promote(
        self, key: ChunkKey, owner: str, prefetch: bool = False, tiers: TierChoice = None
    ) -> Slot | None:
        """A read lease on ``key`` once it is in L1, or None (a miss).
        ``prefetch``: the lease is a prefetch's (counted apart). ``tiers``:
        the only tiers it may come from (a request's load tiers; None: all)."""
        if self.l2 is not None and allows(tiers, "l2"):
            slot = self._from_l2(self.l2, key, owner, prefetch)
            if slot is not None:
                return slot
        if self.shared is not None and allows(tiers, self.shared.name):
            return self._from_shared(self.shared, key, owner, prefetch)
        return None

    def _from_l2(self, l2: DiskTier, key: ChunkKey, owner: str, prefetch: bool) -> Slot | None:
        info = l2.peek(key)
        if info is None:
            return None
        entry, slot = self._index.reserve(key, info.payload_bytes, info.meta, owner, prefetch)
        if entry is None:
            return slot
        view = self._buf[entry.offset : entry.offset + entry.length]
        try:
            meta = l2.read_into(key, view)
        except Exception:
            logger.exception("L2 read of a chunk failed")
            meta = None
        if meta is None:
            self._index.fail(entry)
            return None
        return self._index.publish(entry, meta, owner, "l2", prefetch)

    def _from_shared(self, shared: Tier, key: ChunkKey, owner: str, prefetch: bool) -> Slot | None:
        """The shared tier writes the payload straight into the reserved slot
        (``Tier.get_into``), reserved once the object's header says its size."""
        reserved: list[tuple[Entry | None, Slot | None]] = []

        def place(nbytes: int, meta: ChunkMeta) -> memoryview | None:
            entry, slot = self._index.reserve(key, nbytes, meta, owner, prefetch)
            reserved.append((entry, slot))
            return None if entry is None else self._buf[entry.offset : entry.offset + entry.length]

        try:
            meta = shared.get_into(key, place)
        except Exception:  # a tier must not raise; a failure is a miss
            logger.exception("shared tier %s raised from get_into", shared.name)
            meta = None
        if not reserved:
            return None
        entry, slot = reserved[0]
        if entry is None:
            return slot
        if meta is None:  # what was written there is no valid payload
            self._index.fail(entry)
            return None
        return self._index.publish(entry, meta, owner, shared.name, prefetch)
