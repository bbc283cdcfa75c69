"""What arrived in and left each tier, in order: the feed behind KV events.

Why: routers that place requests by cache contents (llm-d, Dynamo, AIBrix)
learn them from vLLM's KV events. vLLM publishes its own GPU blocks; the
connector adds ours per tier (L1 = CPU, L2 = local storage, the shared tier
= remote storage) from this journal, read with the EVENTS op.

Each record is ``(seq, kind, tier, key)``: ``seq`` grows by one per record
and is never reused, so a reader asks "everything after N" and learns from
the first sequence number it gets whether it fell behind (records are kept
in a bounded ring: a reader that lags by more than ``capacity`` loses the
oldest, and is told how many). Recording is a deque append under a lock
that is never held while anything else is locked by this module: cheap
enough to call from under the engine's index lock.

Only what this sidecar did is recorded: a shared tier's own evictions
(Valkey's LRU, an S3 lifecycle rule) are invisible to it.
"""

from __future__ import annotations

import secrets
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

__all__ = ["REMOVED", "STORED", "EventJournal", "JournalRead", "TierEvents"]

STORED = "stored"
REMOVED = "removed"
EventKind = Literal["stored", "removed"]
DEFAULT_CAPACITY = 65536
SCAN_FACTOR = 8  # records one read may look at per record it may return

Record = tuple[int, str, str, bytes]  # seq, kind, tier, key


@dataclass(frozen=True, slots=True)
class JournalRead:
    records: list[Record]
    next_seq: int  # ask for records after this next time
    lost: int  # records the reader missed because the ring overflowed


class EventJournal:
    """A bounded, ordered log of tier changes (module docstring). Thread-safe."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self._ring: deque[Record] = deque(maxlen=capacity)
        self._lock = threading.Lock()
        self._last_seq = 0
        self.recorded_total = 0
        # Names this journal's numbering: a reader that sees another id (the
        # sidecar restarted) starts again from 0.
        self.journal_id = secrets.randbits(63)

    def record(self, kind: EventKind, tier: str, key: bytes) -> None:
        with self._lock:
            self._last_seq += 1
            self._ring.append((self._last_seq, kind, tier, bytes(key)))
            self.recorded_total += 1

    def for_tier(self, tier: str) -> TierEvents:
        """Callbacks that record ``tier``'s stores and removals."""
        return TierEvents(
            stored=lambda key: self.record(STORED, tier, key),
            removed=lambda key: self.record(REMOVED, tier, key),
        )

    @property
    def last_seq(self) -> int:
        with self._lock:
            return self._last_seq

    def read(
        self,
        after: int,
        limit: int,
        keep: Callable[[bytes], bool] | None = None,
    ) -> JournalRead:
        """Up to ``limit`` records with ``seq > after`` whose key ``keep``
        accepts (all when None), scanning at most ``SCAN_FACTOR * limit``
        records; ``next_seq`` moves past the records ``keep`` refused too, so
        a reader never rescans them."""
        with self._lock:
            last = self._last_seq
            if after > last:  # a reader of a previous sidecar's numbering: start over
                after = 0
            ring = self._ring
            first = ring[0][0] if ring else last + 1
            start = max(0, after + 1 - first)
            stop = min(len(ring), start + SCAN_FACTOR * max(limit, 1))
            scanned = [ring[i] for i in range(start, stop)]
        lost = max(0, first - after - 1) if scanned else 0
        out: list[Record] = []
        next_seq = after
        for record in scanned:
            if len(out) >= limit:
                break
            next_seq = record[0]
            if keep is None or keep(record[3]):
                out.append(record)
        return JournalRead(out, next_seq, lost)


@dataclass(frozen=True, slots=True)
class TierEvents:
    """What a tier calls when a chunk arrives in it or leaves it."""

    stored: Callable[[bytes], None]
    removed: Callable[[bytes], None]
