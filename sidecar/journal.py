"""What arrived in and left each tier, in order: the feed behind KV events.

Why: routers that place requests by cache contents (llm-d, Dynamo, AIBrix)
learn them from vLLM's KV events. vLLM publishes its own GPU blocks; the
connector adds ours per tier (L1 = CPU, L2 = local storage, the shared tier
= remote storage) from this journal, read with the EVENTS op.

Each record is ``(seq, kind, tier, key)``: ``seq`` grows by one per record
and is never reused, so a reader asks "everything after N" and learns from
the first sequence number it gets whether it fell behind (records are kept
in a bounded ring: a reader that lags by more than ``capacity`` loses the
oldest, and is told how many of *its own namespace's* records it lost: the
count of another tenant's records would tell it that tenant's write volume).
Recording is a deque append under a lock that is never held while anything
else is locked by this module: cheap enough to call from under the L1
index's lock.

Each journal has its own ``journal_id``, new with every sidecar process: a
reader that sees another id knows the sidecar restarted, and with it that
L1 (process memory) lost everything the old journal announced there, while
L2's files and the shared tier's objects are still held (the connector's
event feed says so to routers, :mod:`kvstrata.connector.events`).

Only what this sidecar did is recorded: a shared tier's own evictions
(Valkey's LRU, an S3 lifecycle rule) are invisible to it.
"""

from __future__ import annotations

import bisect
import secrets
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from kvstrata.sidecar.keys import FINGERPRINT_BYTES

__all__ = ["REMOVED", "STORED", "EventJournal", "JournalRead", "TierEvents"]

STORED = "stored"
REMOVED = "removed"
EventKind = Literal["stored", "removed"]
DEFAULT_CAPACITY = 65536
SCAN_FACTOR = 8  # records one read may look at per record it may return
# Namespaces whose dropped records are remembered (oldest forgotten first):
# bounds what a client naming many fingerprints can make the journal hold.
MAX_TRACKED_NAMESPACES = 256

Record = tuple[int, str, str, bytes]  # seq, kind, tier, key


@dataclass(frozen=True, slots=True)
class JournalRead:
    records: list[Record]
    next_seq: int  # ask for records after this next time
    lost: int  # records the reader missed because the ring overflowed


class EventJournal:
    """A bounded, ordered log of tier changes (module docstring). Thread-safe."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self._capacity = capacity
        self._ring: deque[Record] = deque(maxlen=capacity)
        # Per namespace, the seqs of its records the ring dropped (ascending),
        # so a reader's ``lost`` counts its own namespace's records only.
        self._dropped: OrderedDict[bytes, deque[int]] = OrderedDict()
        self._lock = threading.Lock()
        self._last_seq = 0
        self.recorded_total = 0
        # Names this journal's numbering: a reader that sees another id (the
        # sidecar restarted) starts again from 0.
        self.journal_id = secrets.randbits(63)

    def record(self, kind: EventKind, tier: str, key: bytes) -> None:
        with self._lock:
            if len(self._ring) == self._capacity:
                self._note_dropped(self._ring[0])
            self._last_seq += 1
            self._ring.append((self._last_seq, kind, tier, bytes(key)))
            self.recorded_total += 1

    def _note_dropped(self, record: Record) -> None:
        """Caller holds the lock: ``record`` is about to fall out of the ring."""
        namespace = record[3][:FINGERPRINT_BYTES]
        seqs = self._dropped.get(namespace)
        if seqs is None:
            if len(self._dropped) >= MAX_TRACKED_NAMESPACES:
                self._dropped.popitem(last=False)
            seqs = self._dropped[namespace] = deque(maxlen=self._capacity)
        else:
            self._dropped.move_to_end(namespace)
        seqs.append(record[0])

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
        namespace: bytes | None = None,
    ) -> JournalRead:
        """Up to ``limit`` records with ``seq > after`` whose key starts with
        ``namespace`` (all when None), scanning at most ``SCAN_FACTOR * limit``
        records; ``next_seq`` moves past the other namespaces' records too, so
        a reader never rescans them. ``lost`` counts the dropped records of
        ``namespace`` only (of every namespace when None)."""
        keep: Callable[[bytes], bool] | None = None
        if namespace is not None:
            n = len(namespace)
            keep = lambda key: key[:n] == namespace  # noqa: E731
        with self._lock:
            last = self._last_seq
            if after > last:  # a reader of a previous sidecar's numbering: start over
                after = 0
            ring = self._ring
            first = ring[0][0] if ring else last + 1
            start = max(0, after + 1 - first)
            stop = min(len(ring), start + SCAN_FACTOR * max(limit, 1))
            scanned = [ring[i] for i in range(start, stop)]
            lost = self._lost(after, first, namespace) if scanned else 0
        out: list[Record] = []
        next_seq = after
        for record in scanned:
            if len(out) >= limit:
                break
            next_seq = record[0]
            if keep is None or keep(record[3]):
                out.append(record)
        return JournalRead(out, next_seq, lost)

    def _lost(self, after: int, first: int, namespace: bytes | None) -> int:
        """Caller holds the lock: records after ``after`` the ring dropped
        (``first`` is its oldest seq), of ``namespace`` only when given."""
        if after + 1 >= first:
            return 0
        if namespace is None:
            return first - after - 1
        seqs = self._dropped.get(namespace[:FINGERPRINT_BYTES])
        if not seqs:
            return 0
        return len(seqs) - bisect.bisect_right(seqs, after)


@dataclass(frozen=True, slots=True)
class TierEvents:
    """What a tier calls when a chunk arrives in it or leaves it."""

    stored: Callable[[bytes], None]
    removed: Callable[[bytes], None]
