"""Prefetch: promotions into L1 on background threads, pinned for an owner.

Why an object of its own: a prefetch outlives the call that started it, so
someone must know which owners still have chunks on their way, end the
leases of those that land after their owner was released, and let ``flush``
and ``close`` wait for them. The engine decides what to prefetch (under its
lock) and how a chunk is acquired; this object runs and tracks the jobs.

State (process memory only)::

    pending:     futures not yet done (``flush`` waits for none)
    in_flight:   owner -> prefetch jobs not yet finished
    ended:       owners released while their prefetches ran

Locking: it shares the engine's lock (and its condition); methods say
whether the caller holds it. Why shared: a release of an owner (the engine,
under its lock, ending that owner's leases) and a prefetch landing for it
must be one step against the other -- a lease taken after the release was
decided must be ended (``end_lease``, which works on the engine's lease
table) and none taken before it may be missed. With a lock of its own, the
ended-owner set and the lease table could disagree between the two.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from kvstrata.sidecar.keys import ChunkKey
from kvstrata.sidecar.leases import Slot, client_of
from kvstrata.sidecar.tierchoice import TierChoice

__all__ = ["PREFETCH_THREADS", "Prefetcher"]

logger = logging.getLogger(__name__)

PREFETCH_THREADS = 4


class Prefetcher:
    """Background promotions of one engine (see the module docstring)."""

    def __init__(
        self,
        cond: threading.Condition,
        acquire: Callable[[ChunkKey, str, TierChoice], Slot | None],
        end_lease: Callable[[int], None],
    ) -> None:
        """``acquire`` takes a read lease (promoting as needed); ``end_lease``
        ends one by id, called with the lock held."""
        self._cond = cond
        self._acquire = acquire
        self._end_lease = end_lease
        self._pool = ThreadPoolExecutor(PREFETCH_THREADS, thread_name_prefix="kvstrata-prefetch")
        self._pending: set[Future[object]] = set()
        self._in_flight: dict[str, set[ChunkKey]] = {}  # owner -> keys on their way
        self._ended: set[str] = set()

    def expect(self, owner: str, keys: Sequence[ChunkKey]) -> None:
        """Caller holds the lock: jobs of ``owner`` for ``keys`` are about to start.

        Noted before the jobs exist, so that a release of ``owner`` from now
        on knows to end the leases they will take."""
        self._in_flight.setdefault(owner, set()).update(keys)

    def in_flight(self, owner: str) -> set[ChunkKey]:
        """Caller holds the lock: the keys ``owner``'s running jobs are fetching."""
        return set(self._in_flight.get(owner, ()))

    def queued(self) -> int:
        """Caller holds the lock: chunks on their way into L1 for some owner (the
        loads a lookup started that have not landed yet)."""
        return sum(len(keys) for keys in self._in_flight.values())

    def start(self, keys: Sequence[ChunkKey], owner: str, tiers: TierChoice = None) -> None:
        """Without the lock: one job per key (after :meth:`expect`), each
        promoting only from ``tiers`` (None: every tier)."""
        for key in keys:
            future = self._pool.submit(self._one, key, owner, tiers)
            with self._cond:
                self._pending.add(future)
            future.add_done_callback(self._done)

    def owner_released(self, owner: str) -> None:
        """Caller holds the lock: leases ``owner``'s running jobs take end at once."""
        if owner in self._in_flight:
            self._ended.add(owner)

    def client_released(self, client: str) -> None:
        """Caller holds the lock: :meth:`owner_released` for every owner of ``client``."""
        for owner in self._in_flight:
            if client_of(owner) == client:
                self._ended.add(owner)

    def wait(self, timeout: float | None) -> bool:
        """Wait until no job is pending; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending, timeout=timeout)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _one(self, key: ChunkKey, owner: str, tiers: TierChoice) -> None:
        slot = None
        try:
            slot = self._acquire(key, owner, tiers)
        except Exception:
            logger.exception("prefetch of a chunk failed")
        with self._cond:
            ended = owner in self._ended
            left = self._in_flight.get(owner, set())
            left.discard(key)
            if not left:
                self._in_flight.pop(owner, None)
                self._ended.discard(owner)
            # The request ended while this chunk was on its way: its lease
            # would otherwise pin the chunk until it expires.
            if ended and slot is not None:
                self._end_lease(slot.lease_id)

    def _done(self, future: Future[object]) -> None:
        with self._cond:
            self._pending.discard(future)
            self._cond.notify_all()
