"""Promotion: a read lease on a chunk, copying it up into L1 from L2 or the
shared tier when L1 lacks it.

Why its own module: it is the one path that moves bytes into the arena from
below (L2 and, where it can, the shared tier read straight into the
reserved slot), with its own protocol against concurrent readers: the entry is
reserved ``promoting``, filled, then published with a read lease for the
caller, and everyone waiting for that key is woken. A failed read aborts
the entry (a miss, counted); an entry removed meanwhile is dropped at its
last pin.

:class:`Promotion` does the I/O half and holds no lock. Each step on the L1
index is one call of :class:`~kvstrata.sidecar.l1index.L1Index`, which takes
its lock itself: ``acquire`` (L1 already holds it), ``reserve_promotion``,
``publish_promotion``, ``fail_promotion``. Reads (the engine's and the
prefetcher's) come through :meth:`Promotion.acquire`, which drops chunks
past their tenant's TTL first.
"""

from __future__ import annotations

import logging

from kvstrata.sidecar.keys import ChunkKey
from kvstrata.sidecar.l1 import Entry
from kvstrata.sidecar.l1index import L1Index
from kvstrata.sidecar.leases import Slot
from kvstrata.sidecar.objformat import ChunkMeta
from kvstrata.sidecar.tierchoice import TierChoice, allows
from kvstrata.sidecar.tiers.base import Tier
from kvstrata.sidecar.tiers.disk import DiskTier

__all__ = ["Promotion"]

logger = logging.getLogger(__name__)


class Promotion:
    """Brings chunks from L2 or the shared tier into L1 (module docstring)."""

    def __init__(
        self, index: L1Index, buf: memoryview, l2: DiskTier | None, shared: Tier | None
    ) -> None:
        self._index = index
        self._buf = buf  # the arena
        self.l2 = l2
        self.shared = shared

    def expire(self) -> None:
        """Remove the chunks older than their tenant's TTL from L1 and L2 (a
        read then misses). Run before every lookup and read."""
        old = self._index.expire_ttl()
        for key in old if self.l2 is not None else ():
            self.l2.remove(key)  # file I/O: never under the index's lock

    def acquire(
        self, key: ChunkKey, owner: str, prefetch: bool = False, tiers: TierChoice = None
    ) -> Slot | None:
        """A read lease on ``key``: L1's, or after a promotion from a tier of
        ``tiers`` (None: every tier); None is a miss. ``prefetch``: the lease
        is a prefetch's (counted apart)."""
        self.expire()
        slot, absent = self._index.acquire(key, owner, prefetch)
        if slot is not None or not absent:
            return slot
        return self.promote(key, owner, prefetch, tiers)

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
        entry, slot = self._index.reserve_promotion(
            key, info.payload_bytes, info.meta, owner, prefetch
        )
        if entry is None:
            return slot
        view = self._buf[entry.offset : entry.offset + entry.length]
        try:
            meta = l2.read_into(key, view)
        except Exception:
            logger.exception("L2 read of a chunk failed")
            meta = None
        if meta is None:
            self._index.fail_promotion(entry)
            return None
        return self._index.publish_promotion(entry, meta, owner, "l2", prefetch)

    def _from_shared(self, shared: Tier, key: ChunkKey, owner: str, prefetch: bool) -> Slot | None:
        """The shared tier writes the payload straight into the reserved slot
        (``Tier.get_into``), reserved once the object's header says its size."""
        reserved: list[tuple[Entry | None, Slot | None]] = []

        def place(nbytes: int, meta: ChunkMeta) -> memoryview | None:
            entry, slot = self._index.reserve_promotion(key, nbytes, meta, owner, prefetch)
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
            self._index.fail_promotion(entry)
            return None
        return self._index.publish_promotion(entry, meta, owner, shared.name, prefetch)
