"""Write-behind: copies of L1 chunks flowing down into L2 and the shared tier.

Why an object of its own: a queued write pins its L1 entry until the write
finishes, so write-behind decides how much of the arena is pinned for
copies below L1. One object knows that budget, the writes waiting for it
and which chunks the shared tier already holds; the engine only says what
happened to a chunk (stored, read, promoted, forgotten).

State (process memory only)::

    pinned:       bytes of L1 entries pinned by writes queued or running
    backlog:      (key, shared) -> (entry, queue), oldest first: writes
                  waiting for the pin budget
    known_shared: key -> store tiers, most recent last: chunks the shared tier
                  holds (bounded; a forgotten key is at worst uploaded twice),
                  with the tier choice of the request that stored each one
                  here (None: every tier, or not stored by this sidecar)
    ready:        (queue, job) pairs to hand to their queues

Keys name content, so every tier must answer a key with the same bytes. The
shared tier never overwrites an object (its first writer wins): when an
upload finds the key already there, this sidecar's own copies yield to it --
the L1 entry leaves the index and the L2 object is removed (also when the L2
write of that entry ends later) -- and the next read promotes the shared
tier's bytes, counted in ``shared_already_held_total``. Checking the shared
tier before each store instead would put a network round trip on every
PREPARE_STORE; the upload already asks, for free.

Write-behind may pin at most ``WRITEBACK_PIN_FRACTION`` of the arena;
further writes wait in the backlog (oldest first) and are lost -- counted
in ``writeback_skipped_total`` -- only if evicted before their turn. A slow
disk thus costs L2 copies, never L1 stores.

It is the L1 index's listener (:mod:`.index_listener`): the index tells it
of every commit, read and promotion, and it pins, unpins and drops L1
entries only through the index (:meth:`L1Index.pin_current`, ``unpin``,
``yield_to_shared``); it never sees the L1 store.

Locking: a lock of its own guards the state above. It may call the index
while holding it (the index's lock is taken inside this one), never the
other way round: the index tells its listener with its own lock released.
Jobs are handed to their queues (:meth:`submit`) with neither held, because
a queue that drops a job calls its ``on_dropped`` at once, which takes this lock.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import replace
from functools import partial

from kvstrata.sidecar.arena import Arena
from kvstrata.sidecar.config import SidecarConfig
from kvstrata.sidecar.journal import TierEvents
from kvstrata.sidecar.keys import ChunkKey
from kvstrata.sidecar.l1 import Entry
from kvstrata.sidecar.l1index import L1Index
from kvstrata.sidecar.tenants import TenantRules
from kvstrata.sidecar.tierchoice import TierChoice, allows
from kvstrata.sidecar.tiers.base import Tier, TierStats, WriteBehindQueue, WriteJob

__all__ = ["WriteBehind"]

KNOWN_SHARED_MAX = 65536
WRITEBACK_PIN_FRACTION = 0.5
WRITEBACK_BACKLOG_MAX = 4096


def may_copy(entry: Entry, tier: str) -> bool:
    """Whether write-behind may copy ``entry`` below L1 into ``tier`` ("l2" or
    "shared"): the request that stored it may have kept it out of some tiers
    (:mod:`kvstrata.sidecar.tierchoice`). Its tenant's rules are the other half
    of the decision (:meth:`WriteBehind._keeps`)."""
    return allows(entry.meta.store_tiers, tier)


class WriteBehind:
    """The write-behind queues of one engine and what they pin (module docstring)."""

    def __init__(
        self,
        config: SidecarConfig,
        arena: Arena,
        index: L1Index,
        rules: TenantRules,
        l2: Tier | None,
        shared: Tier | None,
    ) -> None:
        """``rules``: the tenants' (which tiers below L1 each one's chunks may go to)."""
        self._index = index
        self._rules = rules
        self._buf = arena.buffer
        self._lock = threading.Lock()
        self._l2 = l2
        self._shared = shared
        self._admit_all = config.shared.admission == "all"
        self.pinned = 0
        self._pin_limit = int(arena.size * WRITEBACK_PIN_FRACTION)
        self._backlog: OrderedDict[tuple[ChunkKey, bool], tuple[Entry, WriteBehindQueue]] = (
            OrderedDict()
        )
        self._known_shared: OrderedDict[ChunkKey, TierChoice] = OrderedDict()
        # deque appends and pops are atomic: any thread may submit any job.
        self._ready: deque[tuple[WriteBehindQueue, WriteJob]] = deque()
        self._l2_queue: WriteBehindQueue | None = None
        self._shared_queue: WriteBehindQueue | None = None
        if l2 is not None:
            self._l2_queue = WriteBehindQueue(
                l2,
                config.l2.write_queue_depth,
                config.l2.writer_threads,
                already_stored=l2.contains,
            )
        if shared is not None:
            self._shared_queue = WriteBehindQueue(
                shared,
                config.shared.write_queue_depth,
                config.shared.writer_threads,
                already_stored=self._known_shared.__contains__,
            )

    def figures(self) -> tuple[int, int]:
        """(bytes pinned, writes parked in the backlog) at one moment."""
        with self._lock:
            return self.pinned, len(self._backlog)

    def tell_shared_writes(self, events: TierEvents) -> None:
        """Record every chunk the shared tier's writers store (the KV event journal)."""
        if self._shared_queue is not None:
            self._shared_queue.events = events

    # -- what happened to a chunk (the index's listener) ----------------------

    def stored(self, entry: Entry) -> None:
        """A client's chunk was committed: copy it to L2 and, per admission,
        to the shared tier now or on its first read (each only where the
        storing request and its tenant allow it: :meth:`_keeps`)."""
        if self._l2_queue is None and self._shared_queue is None:
            return  # nothing below L1 (decided once, at start): no lock per store
        with self._lock:
            self._queue_l2(entry)
            if self._shared_queue is not None and self._keeps(entry, "shared"):
                if self._admit_all:
                    self._queue_shared(entry)
                else:
                    entry.shared_pending = True
        self.submit()

    def read(self, entry: Entry) -> None:
        """A chunk was read: "reused" admission uploads it now."""
        if not entry.shared_pending:  # the common case, decided without the lock
            return
        with self._lock:
            if entry.shared_pending:
                entry.shared_pending = False
                self._queue_shared(entry)
        self.submit()

    def promoted(self, entry: Entry, tier: str) -> None:
        """A chunk came up from ``tier`` ("l2" or the shared tier's name)."""
        with self._lock:
            if tier == "l2":
                if not self._admit_all:
                    self._queue_shared(entry)  # "reused": this is a hit
            else:
                self._note_shared(entry.key, entry.meta.store_tiers)
                self._queue_l2(entry)
        self.submit()

    def shared_choice(self, key: ChunkKey) -> TierChoice:
        """The tier choice ``key`` was uploaded with by this sidecar (None: every
        tier, or unknown): a chunk promoted from the shared tier keeps it."""
        with self._lock:
            return self._known_shared.get(key)

    def forget(self, key: ChunkKey) -> None:
        with self._lock:
            self._known_shared.pop(key, None)

    def forget_all(self) -> None:
        with self._lock:
            self._known_shared.clear()

    # -- queueing (with the lock held) ----------------------------------------

    def _note_shared(self, key: ChunkKey, store_tiers: TierChoice = None) -> None:
        """The shared tier holds ``key``, stored by a request that chose ``store_tiers``."""
        self._known_shared[key] = store_tiers
        self._known_shared.move_to_end(key)
        while len(self._known_shared) > KNOWN_SHARED_MAX:
            self._known_shared.popitem(last=False)

    def _count_skipped(self) -> None:
        with self._index.tally() as counts:
            counts.writeback_skipped_total += 1

    def _keeps(self, entry: Entry, tier: str) -> bool:
        """Whether ``entry`` may go to ``tier`` ("l2", "shared"), the one place
        that decides: the request that stored it (:func:`may_copy`) and its
        tenant's rules (:func:`kvstrata.sidecar.tenants.lower_tiers_for`) must
        both allow it."""
        return may_copy(entry, tier) and tier in self._rules.lower_tiers(entry.meta.tenant)

    def _queue_l2(self, entry: Entry) -> None:
        if self._l2_queue is None or self._l2 is None or self._l2.contains(entry.key):
            return
        if self._keeps(entry, "l2"):
            self._queue_write(entry, self._l2_queue, shared=False)

    def _queue_shared(self, entry: Entry) -> None:
        if self._shared_queue is None or entry.key in self._known_shared:
            return
        if self._keeps(entry, "shared"):
            self._queue_write(entry, self._shared_queue, shared=True)

    def _queue_write(self, entry: Entry, queue: WriteBehindQueue, shared: bool) -> None:
        """Queue one write of ``entry``, or park it in the backlog while
        write-behind already pins its share of the arena."""
        self._backlog[(entry.key, shared)] = (entry, queue)
        while len(self._backlog) > WRITEBACK_BACKLOG_MAX:
            self._backlog.popitem(last=False)
            self._count_skipped()
        self._drain_backlog()

    def _drain_backlog(self) -> None:
        """Pin and queue parked writes, oldest first, while the budget allows
        (at least one write is always allowed)."""
        backlog = self._backlog
        while backlog:
            (key, shared), (entry, queue) = next(iter(backlog.items()))
            if self.pinned and self.pinned + entry.length > self._pin_limit:
                if self._index.pin_current(entry, pin=False):
                    return  # it waits for the budget
                del backlog[(key, shared)]  # evicted or removed before its turn
                self._count_skipped()
                continue
            del backlog[(key, shared)]
            if not self._index.pin_current(entry):
                self._count_skipped()  # evicted or removed before its turn
                continue
            self.pinned += entry.length
            view = self._buf[entry.offset : entry.offset + entry.length]
            done = self._done_callback(entry, shared)
            job = WriteJob(
                entry.key, view, entry.meta, on_done=done, on_dropped=partial(done, False, False)
            )
            if shared:
                job.on_present = self._present_callback(entry)
            self._ready.append((queue, job))

    def _present_callback(self, entry: Entry) -> Callable[[], None]:
        """What to do when the shared tier already held ``entry``'s key: drop
        this sidecar's copies, so every tier answers with the shared bytes."""

        def present() -> None:
            # Marks the entry yielded before L2's copy is removed: an L2 write
            # of this entry that ends after this removal sees it and removes its own.
            self._index.yield_to_shared(entry)
            if self._l2 is not None:
                self._l2.remove(entry.key)  # file I/O: never under a lock

        return present

    def _done_callback(self, entry: Entry, shared: bool) -> Callable[[bool, bool], None]:
        def done(ok: bool, attempted: bool = True) -> None:
            """``ok``: the write stored it; ``attempted``: the tier was asked
            (False: the queue dropped the job)."""
            superseded: tuple[ChunkKey, ...] = ()
            if ok and not shared and entry.yielded and self._l2 is not None:
                # Written after the shared tier's answer. Read without the lock:
                # ``present`` sets the flag before it removes L2's copy, so either
                # this sees it or that removal comes after this write. Before the
                # pin goes, so a drained write-behind has no such copy left.
                self._l2.remove(entry.key)
            if ok and not shared:  # its age, where its tenant has a TTL
                self._index.l2_holds(entry.meta.tenant, entry.key)
            self._index.unpin(entry)
            with self._lock:
                self.pinned -= entry.length
                if ok and shared:
                    self._note_shared(entry.key, entry.meta.store_tiers)
                    superseded, entry.supersedes = entry.supersedes, ()
                # A writer is free again, stored or failed: the next parked write
                # goes (else, after a run of failures, parked writes would wait
                # for the next store). Not after a drop: the queue is full, and
                # each freed pin would send one more parked write to be dropped.
                if attempted:
                    self._drain_backlog()
            if superseded:
                with self._index.tally() as counts:
                    counts.partial_superseded_deleted_total += len(superseded)
            if superseded and self._shared is not None:
                # On the writer's thread, after the chunk that replaces them
                # is there: a reader meanwhile finds one or the other.
                self._shared.remove_many(superseded)
            self.submit()

        return done

    # -- without the lock -----------------------------------------------------

    def submit(self) -> None:
        """Hand the queued jobs to their queues (never with the lock held)."""
        ready = self._ready
        while ready:
            try:
                queue, job = ready.popleft()
            except IndexError:  # another thread took the last one
                return
            queue.submit(job)

    def flush(self, left: Callable[[], float | None]) -> bool:
        """Write everything queued or parked; False when ``left()`` runs out."""
        while True:
            with self._lock:
                self._drain_backlog()
                parked = len(self._backlog)
            self.submit()
            for queue in (self._l2_queue, self._shared_queue):
                if queue is not None and not queue.flush(timeout=left()):
                    return False
            if not parked:
                return True

    def tier_stats(self, stats: TierStats) -> TierStats:
        """``stats`` of a tier below L1 with its queue's depth and drops."""
        queue = self._l2_queue if stats.tier == "l2" else self._shared_queue
        if queue is None:
            return stats
        return replace(
            stats,
            queue_depth=queue.depth,
            queue_capacity=queue.capacity,
            dropped_total=stats.dropped_total + queue.dropped_total,
        )

    def close(self) -> None:
        for queue in (self._l2_queue, self._shared_queue):
            if queue is not None:
                queue.close()
