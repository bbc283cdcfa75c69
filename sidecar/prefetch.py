"""Prefetch: promotions into L1 on background threads, pinned for an owner.

Why an object of its own: a prefetch outlives the call that started it, so
someone must run the jobs and let ``flush`` and ``close`` wait for them.
The L1 index plans a prefetch (:meth:`L1Index.plan_prefetch`: which chunks
are leased at once, which are fetched) and keeps the keys each owner has on
their way; a job takes its lease through :meth:`Promotion.acquire` and tells
the index when it lands (:meth:`L1Index.prefetch_landed`), which ends the
lease at once when its owner was released meanwhile: a release and a
landing are one step against the other under the index's lock.

State (process memory only)::

    pending:     futures not yet done (``flush`` waits for none)

Locking: a condition of its own guards ``pending``; it is never held while
the index is asked.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from kvstrata.sidecar.keys import ChunkKey
from kvstrata.sidecar.l1index import L1Index
from kvstrata.sidecar.promotion import Promotion
from kvstrata.sidecar.tierchoice import TierChoice

__all__ = ["PREFETCH_THREADS", "Prefetcher"]

logger = logging.getLogger(__name__)

PREFETCH_THREADS = 4


class Prefetcher:
    """Background promotions of one engine (see the module docstring)."""

    def __init__(self, index: L1Index, promotion: Promotion) -> None:
        self._index = index
        self._promotion = promotion
        self._pool = ThreadPoolExecutor(PREFETCH_THREADS, thread_name_prefix="kvstrata-prefetch")
        self._cond = threading.Condition()
        self._pending: set[Future[object]] = set()

    def start(self, keys: Sequence[ChunkKey], owner: str, tiers: TierChoice = None) -> None:
        """One job per key of a plan (:meth:`L1Index.plan_prefetch`), each
        promoting only from ``tiers`` (None: every tier)."""
        for key in keys:
            future = self._pool.submit(self._one, key, owner, tiers)
            with self._cond:
                self._pending.add(future)
            future.add_done_callback(self._done)

    def wait(self, timeout: float | None) -> bool:
        """Wait until no job is pending; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending, timeout=timeout)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _one(self, key: ChunkKey, owner: str, tiers: TierChoice) -> None:
        slot = None
        try:
            slot = self._promotion.acquire(key, owner, prefetch=True, tiers=tiers)
        except Exception:
            logger.exception("prefetch of a chunk failed")
        self._index.prefetch_landed(owner, key, slot)

    def _done(self, future: Future[object]) -> None:
        with self._cond:
            self._pending.discard(future)
            self._cond.notify_all()
