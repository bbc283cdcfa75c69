"""What the L1 index tells the one part of the engine that copies its chunks.

Why a protocol of its own: write-behind (:mod:`.writeback`) must hear of
every chunk that becomes READY in L1 and of every read (the "reused"
admission uploads on a first hit), but the index (:mod:`.l1index`) must not
depend on write-behind, its queues or its tiers. The index tells its
listener after its lock is released, while the entry it names is still
pinned by the step that tells it, so the listener may pin what it copies
before anything can evict the entry; the listener may call the index back.
"""

from __future__ import annotations

from typing import Protocol

from kvstrata.sidecar.keys import ChunkKey
from kvstrata.sidecar.l1 import Entry
from kvstrata.sidecar.tierchoice import TierChoice

__all__ = ["IndexListener", "NoListener"]


class IndexListener(Protocol):
    """What the index tells (see the module docstring for when)."""

    def stored(self, entry: Entry) -> None:
        """A client's chunk was committed and is READY."""

    def read(self, entry: Entry) -> None:
        """A read lease (or a prefetch's) was taken on ``entry``."""

    def promoted(self, entry: Entry, tier: str) -> None:
        """``entry`` was copied up from ``tier`` and is READY."""

    def shared_choice(self, key: ChunkKey) -> TierChoice:
        """The tier choice ``key`` was uploaded to the shared tier with (None:
        every tier, or unknown): a chunk promoted from there keeps it. Asked
        before the index takes its lock."""


class NoListener:
    """The listener of an index nothing copies below (no write-behind)."""

    def stored(self, entry: Entry) -> None:
        pass

    def read(self, entry: Entry) -> None:
        pass

    def promoted(self, entry: Entry, tier: str) -> None:
        pass

    def shared_choice(self, key: ChunkKey) -> TierChoice:
        return None
