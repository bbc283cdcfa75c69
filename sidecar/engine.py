"""The tiered storage engine of one sidecar: L1 arena, L2 disk, shared tier.

Why one object: the server needs a single thread-safe facade that answers
"how much of this prefix do we have", hands out leased arena slots for the
client to copy into or out of, and moves chunks between tiers behind the
scenes. The pieces live elsewhere: :mod:`~kvstrata.sidecar.arena` (the
segment), :mod:`~kvstrata.sidecar.l1` (index, allocator, policy),
:mod:`~kvstrata.sidecar.leases` (who holds which slot),
:mod:`~kvstrata.sidecar.tiers.disk` (L2) and any shared :class:`Tier`.

Data flow:

* ``reserve`` -> client writes into the slot -> ``commit``: the chunk is
  visible in L1 and queued (write-behind) into L2 and, per
  ``shared.admission``, into the shared tier. Each queued write pins the
  L1 object until the write finishes (``WriteJob.on_done``).
* ``lookup``: the longest prefix present in L1, then L2, then (one batched
  ``contains_many`` under the tier's deadline) the shared tier.
* ``acquire``: a read lease on the L1 object; an L2 or shared hit is
  promoted into L1 first (L2 reads straight into the reserved slot).
* ``prefetch``: the same promotion on background threads; the chunks stay
  pinned under leases of ``owner`` until ``release_owner`` (which also ends
  the leases of prefetches still on their way when it is called). One owner
  holds at most one prefetch lease per chunk, however often it asks.

Leases: every slot handed out is a lease (read or write) with an id that
is never reused. A leased object is never evicted or freed. Leases end by
``release``/``commit``/``abort``, ``release_owner`` or ``expire_leases``.

Locking: one lock guards the index, leases and counters; it is never held
during a copy or any I/O.

No state is persisted here; L2 persists its own files.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from kvstrata.sidecar.arena import Arena, owner_prefix
from kvstrata.sidecar.config import SidecarConfig
from kvstrata.sidecar.keys import ChunkKey
from kvstrata.sidecar.l1 import READY, Entry, L1Store
from kvstrata.sidecar.leases import Lease, LeaseTable, Slot
from kvstrata.sidecar.objformat import ChunkMeta
from kvstrata.sidecar.tiers.base import Tier, TierStats, WriteBehindQueue, WriteJob
from kvstrata.sidecar.tiers.disk import DiskTier

__all__ = ["EngineStats", "LookupResult", "Slot", "StorageManager"]

logger = logging.getLogger(__name__)

ENGINE_OWNER = "engine"
PREFETCH_THREADS = 4
KNOWN_SHARED_MAX = 65536
PROMOTION_WAIT_SECONDS = 5.0
# Write-behind may pin at most this fraction of the arena; further writes
# wait in a backlog (oldest first) and are lost -- counted in
# writeback_skipped_total -- only if evicted before their turn. A slow disk
# thus costs L2 copies, never L1 stores.
WRITEBACK_PIN_FRACTION = 0.5
WRITEBACK_BACKLOG_MAX = 4096


@dataclass(frozen=True, slots=True)
class LookupResult:
    """How much of a prompt's chunk list some tier holds."""

    hit_chunks: int  # longest contiguous prefix present in any tier
    tiers: list[str]  # per hit chunk: "l1" | "l2" | the shared tier's name
    # Chunks each tier was consulted for: those the prefix walk reached it with
    # (not found in a faster tier, before the first chunk no tier holds). A
    # tier's hit rate is its hits over this, exactly.
    asked: dict[str, int] = field(default_factory=dict)


@dataclass
class EngineStats:
    """A snapshot for metrics: per-tier stats and engine counters (base units)."""

    tiers: dict[str, TierStats]
    counters: dict[str, int] = field(default_factory=dict)


class StorageManager:
    """L1 + L2 + shared tier behind one thread-safe API (module docstring)."""

    def __init__(self, config: SidecarConfig, shared_tier: Tier | None = None) -> None:
        self.config = config
        self.arena = Arena(
            config.l1.size_bytes,
            config.l1.shm_name,
            config.l1.pin_memory,
            prefix=owner_prefix(config.server.endpoint),
            fit_to_shm=config.l1.fit_to_shm,
        )
        self._buf = self.arena.buffer
        self._store = L1Store(
            self.arena.size,
            config.l1.policy,
            config.l1.prefix_aware,
            namespace_quota=config.l1.namespace_quota_bytes,
        )
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._leases = LeaseTable()
        self._counters: dict[str, int] = {}
        self._hits = self._misses = self._stored_bytes = self._retrieved_bytes = 0
        self._wb_pinned = 0
        self._wb_pin_limit = int(self.arena.size * WRITEBACK_PIN_FRACTION)
        self._wb_backlog: OrderedDict[tuple[ChunkKey, bool], tuple[Entry, WriteBehindQueue]] = (
            OrderedDict()
        )
        self._known_shared: OrderedDict[ChunkKey, None] = OrderedDict()
        self.l2: DiskTier | None = None
        self._l2_queue: WriteBehindQueue | None = None
        self.shared = shared_tier
        self._shared_queue: WriteBehindQueue | None = None
        self._admit_all = config.shared.admission == "all"
        try:
            if config.l2.enabled:
                self.l2 = DiskTier(
                    config.l2.path,
                    config.l2.size_bytes,
                    namespace_quota=config.l2.namespace_quota_bytes,
                )
                self._l2_queue = WriteBehindQueue(
                    self.l2,
                    config.l2.write_queue_depth,
                    config.l2.writer_threads,
                    already_stored=self.l2.contains,
                )
            if shared_tier is not None:
                self._shared_queue = WriteBehindQueue(
                    shared_tier,
                    config.shared.write_queue_depth,
                    config.shared.writer_threads,
                    already_stored=self._known_shared.__contains__,
                )
        except BaseException:
            self.arena.close()
            raise
        self._l2_index = self.l2.index if self.l2 is not None else {}
        self._pool = ThreadPoolExecutor(PREFETCH_THREADS, thread_name_prefix="kvstrata-prefetch")
        self._pending: set[Future[object]] = set()
        self._prefetching: dict[str, set[ChunkKey]] = {}  # owner -> keys still on their way
        self._owners_ended: set[str] = set()  # owners released while prefetches ran
        self._closed = False

    # -- counters -----------------------------------------------------------

    def _count(self, name: str, n: int = 1) -> None:
        self._counters[name] = self._counters.get(name, 0) + n

    # -- lookup -------------------------------------------------------------

    def lookup(self, keys: Sequence[ChunkKey]) -> LookupResult:
        """Longest contiguous prefix of ``keys`` present in any tier."""
        entries = self._store.entries
        l2 = self._l2_index
        asked = {"l1": 0} if self.l2 is None else {"l1": 0, "l2": 0}

        def local_tier(key: ChunkKey, count: bool = True) -> str | None:
            if count:
                asked["l1"] += 1
            entry = entries.get(key)
            if entry is not None and entry.state == READY:
                return "l1"
            if count and "l2" in asked:
                asked["l2"] += 1
            return "l2" if key in l2 else None

        tiers: list[str] = []
        for key in keys:
            tier = local_tier(key)
            if tier is None:
                break
            tiers.append(tier)
        n_local = len(tiers)
        if n_local < len(keys) and self.shared is not None:
            rest = keys[n_local:]
            try:
                remote = self.shared.contains_many(rest)
            except Exception:  # a tier must not raise; a failure is a miss
                logger.exception("shared tier %s raised from contains_many", self.shared.name)
                remote = []
            name = self.shared.name
            asked[name] = 0
            # Re-check the local indexes: a chunk may have landed while the
            # remote round trip ran (the first was counted by the local walk).
            for i, (key, there) in enumerate(zip(rest, remote, strict=False)):
                tier = local_tier(key, count=i > 0)
                if tier is None:
                    asked[name] += 1
                    tier = name if there else None
                if tier is None:
                    break
                tiers.append(tier)
        with self._lock:
            self._count("lookups_total")
            self._count("lookup_chunks_total", len(keys))
            for tier in set(tiers):
                self._count(f"hit_chunks_total_{tier}", tiers.count(tier))
        return LookupResult(len(tiers), tiers, asked)

    # -- leases -------------------------------------------------------------

    def _end_lease(self, lease: Lease) -> None:
        """Caller holds the lock; undoes one lease (a write lease aborts)."""
        entry = lease.entry
        if lease.write:
            self._abort_entry(entry)
        else:
            self._store.unpin(entry)

    def _abort_entry(self, entry: Entry) -> None:
        if self._store.entries.get(entry.key) is entry:
            self._store.remove(entry.key)
        else:
            entry.dead = True
        entry.promoting = False
        self._store.unpin(entry)
        self._cond.notify_all()

    def _read_lease(
        self, entry: Entry, owner: str
    ) -> tuple[Slot, list[tuple[WriteBehindQueue, WriteJob]]]:
        entry.pins += 1
        self._store.policy.on_access(entry.key)
        self._hits += 1
        self._retrieved_bytes += entry.length
        jobs: list[tuple[WriteBehindQueue, WriteJob]] = []
        if entry.shared_pending:
            entry.shared_pending = False
            self._queue_shared(entry, jobs)
        return self._leases.new(entry, owner, write=False), jobs

    # -- store --------------------------------------------------------------

    def reserve(
        self,
        key: ChunkKey,
        nbytes: int,
        meta: ChunkMeta,
        owner: str,
        parent: ChunkKey | None = None,
    ) -> Slot | None:
        """A write lease on fresh arena space for ``key`` (evicting as needed).

        None when ``key`` is already in L1 (being written or stored) or
        nothing evictable frees enough contiguous space. ``parent`` is the
        previous chunk of the same prompt, for prefix-aware eviction.
        """
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        with self._lock:
            if key in self._store.entries:
                self._count("store_deduplicated_total")
                return None
            entry = self._store.reserve(key, nbytes, meta, parent)
            if entry is None:
                self._count("store_rejected_total")
                return None
            return self._leases.new(entry, owner, write=True)

    def commit(self, slot: Slot) -> bool:
        """The slot's bytes are written: publish the chunk and queue it below."""
        jobs: list[tuple[WriteBehindQueue, WriteJob]] = []
        with self._lock:
            lease = self._leases.get(slot.lease_id)
            if lease is None or not lease.write:
                return False
            self._leases.pop(slot.lease_id)
            entry = lease.entry
            if entry.dead:
                self._store.unpin(entry)
                return False
            self._store.publish(entry)
            self._stored_bytes += entry.length
            self._queue_l2(entry, jobs)
            if self._admit_all:
                self._queue_shared(entry, jobs)
            else:
                entry.shared_pending = True
            self._store.unpin(entry)
        self._submit(jobs)
        return True

    def abort(self, slot: Slot) -> None:
        """Discard a reservation (unknown or already ended leases are ignored)."""
        with self._lock:
            lease = self._leases.get(slot.lease_id)
            if lease is not None and lease.write:
                self._leases.pop(slot.lease_id)
                self._abort_entry(lease.entry)

    def put(
        self,
        key: ChunkKey,
        data: bytes | memoryview,
        meta: ChunkMeta,
        parent: ChunkKey | None = None,
    ) -> bool:
        """reserve + copy + commit; True when this call stored the chunk."""
        view = memoryview(data).cast("B")
        slot = self.reserve(key, len(view), meta, ENGINE_OWNER, parent=parent)
        if slot is None:
            return False
        self._buf[slot.offset : slot.offset + slot.length] = view
        return self.commit(slot)

    # -- write-behind -------------------------------------------------------

    def _queue_l2(self, entry: Entry, jobs: list[tuple[WriteBehindQueue, WriteJob]]) -> None:
        if self._l2_queue is not None and entry.key not in self._l2_index:
            self._queue_write(entry, self._l2_queue, jobs, shared=False)

    def _queue_shared(self, entry: Entry, jobs: list[tuple[WriteBehindQueue, WriteJob]]) -> None:
        if self._shared_queue is not None and entry.key not in self._known_shared:
            self._queue_write(entry, self._shared_queue, jobs, shared=True)

    def _queue_write(
        self,
        entry: Entry,
        queue: WriteBehindQueue,
        jobs: list[tuple[WriteBehindQueue, WriteJob]],
        shared: bool,
    ) -> None:
        """Caller holds the lock: queue one write of ``entry``, or park it in
        the backlog while write-behind already pins its share of the arena."""
        self._wb_backlog[(entry.key, shared)] = (entry, queue)
        while len(self._wb_backlog) > WRITEBACK_BACKLOG_MAX:
            self._wb_backlog.popitem(last=False)
            self._count("writeback_skipped_total")
        self._drain_backlog(jobs)

    def _drain_backlog(self, jobs: list[tuple[WriteBehindQueue, WriteJob]]) -> None:
        """Caller holds the lock: pin and queue parked writes, oldest first,
        while the budget allows (at least one write is always allowed)."""
        backlog = self._wb_backlog
        while backlog:
            (key, shared), (entry, queue) = next(iter(backlog.items()))
            if self._store.entries.get(key) is not entry:
                del backlog[(key, shared)]  # evicted or removed before its turn
                self._count("writeback_skipped_total")
                continue
            if self._wb_pinned and self._wb_pinned + entry.length > self._wb_pin_limit:
                return
            del backlog[(key, shared)]
            entry.pins += 1
            self._wb_pinned += entry.length
            view = self._buf[entry.offset : entry.offset + entry.length]
            done = self._write_done_callback(entry, shared)
            jobs.append((queue, WriteJob(entry.key, view, entry.meta, on_done=done)))

    def _write_done_callback(self, entry: Entry, shared: bool) -> Callable[[bool], None]:
        def done(ok: bool) -> None:
            jobs: list[tuple[WriteBehindQueue, WriteJob]] = []
            with self._lock:
                self._wb_pinned -= entry.length
                self._store.unpin(entry)
                if ok and shared:
                    self._note_shared(entry.key)
                if ok:  # not after a drop: that would cascade through the backlog
                    self._drain_backlog(jobs)
            self._submit(jobs)

        return done

    @staticmethod
    def _submit(jobs: list[tuple[WriteBehindQueue, WriteJob]]) -> None:
        # Outside the lock: a dropped job calls on_done at once, which locks.
        for queue, job in jobs:
            queue.submit(job)

    def _note_shared(self, key: ChunkKey) -> None:
        self._known_shared[key] = None
        self._known_shared.move_to_end(key)
        while len(self._known_shared) > KNOWN_SHARED_MAX:
            self._known_shared.popitem(last=False)

    # -- retrieve -----------------------------------------------------------

    def acquire(self, key: ChunkKey, owner: str) -> Slot | None:
        """A read lease on ``key``, promoting it from L2 or the shared tier
        into L1 when needed (synchronously, within the tiers' deadlines).
        None is a miss."""
        jobs: list[tuple[WriteBehindQueue, WriteJob]] = []
        with self._lock:
            slot = self._acquire_local(key, owner, jobs)
            if slot is None and key not in self._store.entries:
                self._misses += 1
        self._submit(jobs)
        if slot is not None or key in self._store.entries:
            return slot
        return self._promote(key, owner)

    def _acquire_local(
        self, key: ChunkKey, owner: str, jobs: list[tuple[WriteBehindQueue, WriteJob]]
    ) -> Slot | None:
        """Caller holds the lock. Waits for an in-flight promotion of ``key``."""
        deadline = time.monotonic() + PROMOTION_WAIT_SECONDS
        while True:
            entry = self._store.entries.get(key)
            if entry is None:
                return None
            if entry.state == READY:
                slot, more = self._read_lease(entry, owner)
                jobs.extend(more)
                return slot
            if not entry.promoting:
                return None  # a client is still writing it: a miss for now
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self._cond.wait(left)

    def _promote(self, key: ChunkKey, owner: str) -> Slot | None:
        if self.l2 is not None:
            slot = self._promote_from_l2(key, owner)
            if slot is not None:
                return slot
        if self.shared is not None:
            return self._promote_from_shared(key, owner)
        return None

    def _reserve_promotion(
        self, key: ChunkKey, nbytes: int, meta: ChunkMeta, owner: str
    ) -> tuple[Entry | None, Slot | None]:
        """(entry to fill, None) or (None, a read lease when it appeared meanwhile)."""
        jobs: list[tuple[WriteBehindQueue, WriteJob]] = []
        with self._lock:
            entry = self._store.reserve(key, nbytes, meta)
            if entry is not None:
                entry.promoting = True
                return entry, None
            slot = self._acquire_local(key, owner, jobs)
        self._submit(jobs)
        return None, slot

    def _finish_promotion(
        self, entry: Entry, meta: ChunkMeta, owner: str, tier: str, to_l2: bool
    ) -> Slot | None:
        jobs: list[tuple[WriteBehindQueue, WriteJob]] = []
        with self._lock:
            entry.promoting = False
            self._cond.notify_all()
            if entry.dead:
                self._store.unpin(entry)
                return None
            entry.meta = meta
            self._store.publish(entry)
            self._count(f"promotions_total_{tier}")
            if to_l2:
                self._queue_l2(entry, jobs)
            if not self._admit_all and tier == "l2":
                self._queue_shared(entry, jobs)  # "reused": this is a hit
            slot, more = self._read_lease(entry, owner)
            jobs.extend(more)
            self._store.unpin(entry)  # the fill pin; the read lease keeps its own
        self._submit(jobs)
        return slot

    def _fail_promotion(self, entry: Entry) -> None:
        with self._lock:
            self._count("promotion_failed_total")
            self._abort_entry(entry)

    def _promote_from_l2(self, key: ChunkKey, owner: str) -> Slot | None:
        if self.l2 is None:
            return None
        info = self.l2.peek(key)
        if info is None:
            return None
        entry, slot = self._reserve_promotion(key, info.payload_bytes, info.meta, owner)
        if entry is None:
            return slot
        view = self._buf[entry.offset : entry.offset + entry.length]
        try:
            meta = self.l2.read_into(key, view)
        except Exception:
            logger.exception("L2 read of a chunk failed")
            meta = None
        if meta is None:
            self._fail_promotion(entry)
            return None
        return self._finish_promotion(entry, meta, owner, "l2", to_l2=False)

    def _promote_from_shared(self, key: ChunkKey, owner: str) -> Slot | None:
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
        entry, slot = self._reserve_promotion(key, len(payload), obj.meta, owner)
        if entry is None:
            return slot
        self._buf[entry.offset : entry.offset + entry.length] = payload
        with self._lock:
            self._note_shared(key)
        return self._finish_promotion(entry, obj.meta, owner, self.shared.name, to_l2=True)

    def release(self, slot: Slot) -> None:
        """End a read lease."""
        self.release_lease(slot.lease_id)

    def release_lease(self, lease_id: int) -> bool:
        """End a lease by id (a write lease is aborted); False if unknown."""
        with self._lock:
            lease = self._leases.pop(lease_id)
            if lease is None:
                return False
            self._end_lease(lease)
            return True

    def release_owner(self, owner: str) -> int:
        """End every lease of ``owner``; the number ended. Prefetches of
        ``owner`` still running end their leases as soon as they land."""
        with self._lock:
            leases = self._leases.pop_owner(owner)
            for lease in leases:
                self._end_lease(lease)
            if owner in self._prefetching:
                self._owners_ended.add(owner)
            return len(leases)

    def expire_leases(self, now: float | None = None) -> int:
        """End leases older than ``server.lease_seconds`` (``now``: monotonic)."""
        now = time.monotonic() if now is None else now
        cutoff = now - self.config.server.lease_seconds
        with self._lock:
            old = self._leases.pop_older_than(cutoff)
            for lease in old:
                self._end_lease(lease)
            self._count("leases_expired_total", len(old))
            return len(old)

    def get(self, key: ChunkKey) -> bytes | None:
        """acquire + copy + release."""
        slot = self.acquire(key, ENGINE_OWNER)
        if slot is None:
            return None
        try:
            return bytes(self._buf[slot.offset : slot.offset + slot.length])
        finally:
            self.release(slot)

    # -- prefetch -----------------------------------------------------------

    def prefetch(self, keys: Sequence[ChunkKey], owner: str) -> int:
        """Bring ``keys`` into L1 in the background, pinned under leases of
        ``owner``; the number of chunks pinned now or scheduled. Stops at the
        first key no local index knows unless a shared tier may have it.
        Keys ``owner`` already holds a read lease on, or is prefetching, are
        counted as pinned and not leased again."""
        scheduled = 0
        jobs: list[tuple[WriteBehindQueue, WriteJob]] = []
        to_fetch: list[ChunkKey] = []
        with self._lock:
            if self._closed:
                return 0
            pinned = self._leases.read_keys(owner) | self._prefetching.get(owner, set())
            fresh = 0
            for key in keys:
                if key in pinned:
                    scheduled += 1
                    continue
                entry = self._store.entries.get(key)
                if entry is not None and entry.state == READY:
                    _, more = self._read_lease(entry, owner)
                    jobs.extend(more)
                elif entry is not None or key in self._l2_index or self.shared is not None:
                    to_fetch.append(key)
                else:
                    break
                fresh += 1
                scheduled += 1
            self._count("prefetch_chunks_total", fresh)
            # Counted under the lock before the jobs exist: a release_owner
            # from now on knows to end the leases they will take.
            if to_fetch:
                self._prefetching.setdefault(owner, set()).update(to_fetch)
        self._submit(jobs)
        for key in to_fetch:
            future = self._pool.submit(self._prefetch_one, key, owner)
            with self._lock:
                self._pending.add(future)
            future.add_done_callback(self._prefetch_done)
        return scheduled

    def _prefetch_one(self, key: ChunkKey, owner: str) -> None:
        slot = None
        try:
            slot = self.acquire(key, owner)
        except Exception:
            logger.exception("prefetch of a chunk failed")
        with self._lock:
            ended = owner in self._owners_ended
            left = self._prefetching.get(owner, set())
            left.discard(key)
            if not left:
                self._prefetching.pop(owner, None)
                self._owners_ended.discard(owner)
            # The request ended while this chunk was on its way: its lease
            # would otherwise pin the chunk until it expires.
            lease = self._leases.pop(slot.lease_id) if ended and slot is not None else None
            if lease is not None:
                self._end_lease(lease)

    def _prefetch_done(self, future: Future[object]) -> None:
        with self._lock:
            self._pending.discard(future)
            self._cond.notify_all()

    # -- maintenance --------------------------------------------------------

    def remove(self, key: ChunkKey) -> None:
        """Forget ``key`` in every tier (L1 frees it once no lease pins it)."""
        with self._lock:
            self._store.remove(key)
            self._known_shared.pop(key, None)
        if self.l2 is not None:
            self.l2.remove(key)
        if self.shared is not None:
            self.shared.remove(key)

    def clear(self, shared: bool = False) -> None:
        """Forget every chunk in L1 and L2 (and the shared tier's namespace
        only when ``shared`` is set: other sidecars use it too)."""
        with self._lock:
            for key in list(self._store.entries):
                self._store.remove(key)
            self._known_shared.clear()
        if self.l2 is not None:
            self.l2.clear()
        if shared and self.shared is not None:
            self.shared.clear()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for prefetches and write-behind queues; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        with self._cond:
            if not self._cond.wait_for(lambda: not self._pending, timeout=left()):
                return False
        while True:
            jobs: list[tuple[WriteBehindQueue, WriteJob]] = []
            with self._lock:
                self._drain_backlog(jobs)
                parked = len(self._wb_backlog)
            self._submit(jobs)
            for queue in (self._l2_queue, self._shared_queue):
                if queue is not None and not queue.flush(timeout=left()):
                    return False
            if not parked:
                return True

    def stats(self) -> EngineStats:
        with self._lock:
            store = self._store
            l1 = TierStats(
                tier="l1",
                usage_bytes=store.allocator.used_bytes,
                capacity_bytes=store.capacity,
                objects=len(store.entries),
                stored_bytes_total=self._stored_bytes,
                retrieved_bytes_total=self._retrieved_bytes,
                hits_total=self._hits,
                misses_total=self._misses,
                evictions_total=store.evictions_total,
            )
            counters = dict(self._counters)
            counters["leases_active"] = len(self._leases)
            counters["writeback_pinned_bytes"] = self._wb_pinned
            counters["writeback_backlog"] = len(self._wb_backlog)
            counters["l1_free_largest_bytes"] = store.allocator.largest_free
        tiers = {"l1": l1}
        for tier, queue in ((self.l2, self._l2_queue), (self.shared, self._shared_queue)):
            if tier is None:
                continue
            stats = tier.stats()
            if queue is not None:
                stats = replace(
                    stats,
                    queue_depth=queue.depth,
                    queue_capacity=queue.capacity,
                    dropped_total=stats.dropped_total + queue.dropped_total,
                )
            tiers[tier.name] = stats
        return EngineStats(tiers=tiers, counters=counters)

    def close(self) -> None:
        """Stop threads and unlink the shared-memory segment."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)
        for queue in (self._l2_queue, self._shared_queue):
            if queue is not None:
                queue.close()
        if self.l2 is not None:
            self.l2.close()
        self.arena.close()

    def __enter__(self) -> StorageManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
