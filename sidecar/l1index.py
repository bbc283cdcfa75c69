"""The L1 index: the one owner of what the arena holds and who pins it.

Why one owner: a store, a read, a promotion, a lease expiring, a client
ending and write-behind pinning a chunk all change the same tables at once
(an entry, its pins, a lease, a counter). Here one object holds them and
the lock; every public method takes the lock itself, and the rest of the
engine asks it. Nothing else changes the L1 store or the leases.

State (process memory only)::

    store:      L1Store (entries, allocator, eviction policy, tenants' ledger)
    leases:     LeaseTable (read and write leases, quarantined write slots)
    ended:      EndedClients (clients whose session ended: no lease after)
    prefetches: PrefetchOwners (keys on their way into L1, per owner)
    counters:   EngineCounters
    closed:     the engine is closing (no prefetch starts after)

Leases: every slot handed out is a lease with an id never reused; a leased
entry is never evicted or freed. An expired *write* lease leaves the table
at once, but its slot stays pinned (quarantined, and counted against its
client's write bytes) until its writer says it is done (a commit or release
naming it, refused) or its client ends: a late writer (a starved thread, a
stopped process) would otherwise write into a slot another chunk owns by
then. Read leases expire outright: a late reader checks its own copy
against the lease's time (``connector/lease_clock.py``).

Locking: one lock, and a condition on it that readers of a chunk being
promoted wait on. It is never held during a copy, during I/O (one
exception: :meth:`L1Index.plan_prefetch` asks ``below``, which reads L2's
in-memory index under L2's own lock, taken inside this one, never the other
way round), or while the listener (:mod:`.index_listener`) is told anything.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace

from kvstrata.sidecar.counters import EngineCounters, EngineGauges, EngineStats
from kvstrata.sidecar.index_listener import IndexListener, NoListener
from kvstrata.sidecar.journal import TierEvents
from kvstrata.sidecar.keys import ChunkKey
from kvstrata.sidecar.l1 import READY, Entry, L1Store
from kvstrata.sidecar.leases import Lease, LeaseTable, Slot
from kvstrata.sidecar.objformat import ChunkMeta
from kvstrata.sidecar.owners import EndedClients, PrefetchOwners
from kvstrata.sidecar.partials import entry_is_partial, is_partial
from kvstrata.sidecar.tiers.base import TierStats

__all__ = ["L1Index"]

# How long a reader waits for a promotion of its chunk already under way.
PROMOTION_WAIT_SECONDS = 5.0


class L1Index:
    """The L1 store, its leases and counters behind one lock (module docstring)."""

    def __init__(self, store: L1Store) -> None:
        """``store``: a fresh store, from now on changed only through this index."""
        self._store = store
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._leases = LeaseTable()
        self._ended = EndedClients()
        self._prefetches = PrefetchOwners()
        self._counters = EngineCounters()
        self._listener: IndexListener = NoListener()
        self._closed = False

    def listen(self, listener: IndexListener) -> None:
        """Tell ``listener`` of every commit, read and promotion from now on."""
        self._listener = listener

    @contextmanager
    def tally(self) -> Iterator[EngineCounters]:
        """The counters, to count into under the lock: ``with index.tally() as c``."""
        with self._lock:
            yield self._counters

    # -- what L1 holds (the prefix walk's questions)
    def ready_run(self, keys: Sequence[ChunkKey], start: int = 0, partial: bool = False) -> int:
        """How many of ``keys`` from ``start`` on L1 holds READY in a row (as
        full chunks; as partial ones with ``partial``)."""
        n = start
        with self._lock:
            entries = self._store.entries
            while n < len(keys):
                entry = entries.get(keys[n])
                if entry is None or entry.state != READY or is_partial(entry.meta) != partial:
                    break
                n += 1
        return n - start

    def holds(self, key: ChunkKey) -> bool:
        """Whether L1 has an entry for ``key`` in any state."""
        with self._lock:
            return key in self._store.entries

    def partial_keys(self, keys: Iterable[ChunkKey]) -> list[ChunkKey]:
        """Those of ``keys`` L1 holds as partial chunks."""
        with self._lock:
            return [k for k in keys if entry_is_partial(self._store.entries.get(k))]

    # -- store: reserve -> the client writes -> commit
    def reserve(
        self, key: ChunkKey, nbytes: int, meta: ChunkMeta, owner: str, parent: ChunkKey | None
    ) -> Slot | None:
        """A write lease on fresh arena space for ``key`` (evicting as needed);
        None when L1 has ``key`` (counted), the owner's client ended, or no
        room can be made (counted)."""
        with self._lock:
            if key in self._store.entries:
                self._counters.store_deduplicated_total += 1
                return None
            if self._ended.has_owner(owner):
                return None
            entry = self._store.reserve(key, nbytes, meta, parent)
            if entry is None:
                self._counters.store_rejected_total += 1
                return None
            return self._leases.new(entry, owner, write=True)

    def supersede(self, lease_id: int, covers: Sequence[ChunkKey]) -> None:
        """The chunk of write lease ``lease_id`` supersedes the partial chunks
        ``covers`` (see :mod:`.partials`); an ended lease is ignored."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is not None and lease.write:
                lease.entry.supersedes = tuple(covers)

    def commit(self, lease_id: int, ok: bool = True, client: str | None = None) -> bool:
        """Commit (``ok``) or abort the write lease ``lease_id``; True when
        committed. An unknown lease, a read lease or (with ``client``) another
        client's is left as it is (False); a quarantined one is freed."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None and self._free_quarantined(lease_id, client):
                return False
            if lease is None or not lease.write or (client is not None and client != lease.client):
                return False
            self._leases.pop(lease_id)
            entry = lease.entry
            if not ok:
                self._abort_entry(entry)
                return False
            if entry.dead:
                self._store.unpin(entry)
                return False
            self._store.publish(entry)
            self._counters.stored_bytes_total += entry.length
            if is_partial(entry.meta):
                self._counters.partial_stored_total += 1
        self._tell_then_unpin(entry, None)
        return True

    # -- retrieve
    def acquire(self, key: ChunkKey, owner: str, prefetch: bool) -> tuple[Slot | None, bool]:
        """(a read lease, False) when L1 holds ``key`` READY (a promotion under
        way is waited for); (None, True) when L1 lacks it: the caller may promote
        it; (None, False) when it is being written or the owner's client ended."""
        with self._lock:
            if self._ended.has_owner(owner):
                return None, False  # no promotion I/O for a client that is gone
            slot, entry = self._read_local(key, owner, prefetch)
            absent = slot is None and key not in self._store.entries
            if absent and not prefetch:
                self._counters.misses_total += 1
        if entry is not None:
            self._listener.read(entry)
        return slot, absent

    def client_ended(self, client: str) -> bool:
        """Whether :meth:`release_client` was called for ``client``."""
        with self._lock:
            return client in self._ended

    # -- promotion's steps (see :mod:`.promotion`)
    def reserve_promotion(
        self, key: ChunkKey, nbytes: int, meta: ChunkMeta, owner: str, prefetch: bool
    ) -> tuple[Entry | None, Slot | None]:
        """(an entry to fill, None), or (None, a read lease or None) when the key
        appeared meanwhile or no room was found."""
        if meta.tenant and self._store.tenants.rules.get(meta.tenant) is None:
            # A sealed header named a tenant this sidecar does not know (one
            # removed from the config since): the default tenant's, so that
            # metrics labels stay the configured names.
            meta = replace(meta, tenant="")
        with self._lock:
            entry = self._store.reserve(key, nbytes, meta, read_now=True)
            if entry is not None:
                entry.promoting = True
                return entry, None
            if self._ended.has_owner(owner):  # it ended during the tier's lookup
                return None, None
            slot, leased = self._read_local(key, owner, prefetch)
        if leased is not None:
            self._listener.read(leased)
        return None, slot

    def publish_promotion(
        self, entry: Entry, meta: ChunkMeta, owner: str, tier: str, prefetch: bool
    ) -> Slot | None:
        """``entry`` is filled from ``tier``: READY, and a read lease for ``owner``
        (None when it was removed meanwhile or ``owner``'s client ended)."""
        # The storing request's tier choice stays with the chunk: L2's index kept
        # it (in the reserved meta); write-behind knows what it uploaded.
        choice = entry.meta.store_tiers if tier == "l2" else self._listener.shared_choice(entry.key)
        with self._lock:
            entry.promoting = False
            self._cond.notify_all()
            if entry.dead:
                self._store.unpin(entry)
                return None
            # The tenant is the one the reservation was charged to.
            entry.meta = replace(meta, tenant=entry.meta.tenant, store_tiers=choice)
            self._store.publish(entry)
            promotions = self._counters.promotions_total
            promotions[tier] = promotions.get(tier, 0) + 1
            # The chunk stays in L1; a client that ended during the fill gets no lease.
            ended = self._ended.has_owner(owner)
            slot = None if ended else self._read_lease(entry, owner, prefetch)
        self._tell_then_unpin(entry, tier)
        return slot

    def fail_promotion(self, entry: Entry) -> None:
        """The fill of ``entry`` failed: it leaves the index, counted."""
        with self._lock:
            self._counters.promotion_failures_total += 1
            self._abort_entry(entry)

    # -- ending leases
    def release_lease(self, lease_id: int, client: str | None = None) -> bool:
        """End a lease (a write lease aborts); False if unknown or (with
        ``client``) another client's. A quarantined one is freed."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None:
                self._free_quarantined(lease_id, client)  # an expired write: done now
                return False
            if client is not None and client != lease.client:
                return False
            self._leases.pop(lease_id)
            self._end_lease(lease)
            return True

    def release_owner(self, owner: str) -> int:
        """End every lease of ``owner``; the number ended. Prefetches of
        ``owner`` still running end their leases as soon as they land."""
        with self._lock:
            leases = self._leases.pop_owner(owner)
            for lease in leases:
                self._end_lease(lease)
            self._prefetches.release_owner(owner)
            return len(leases)

    def release_client(self, client: str) -> int:
        """End every lease of ``client`` (the number) and free its quarantined
        slots; its prefetches end their leases as they land, and it gets no
        lease from now on."""
        with self._lock:
            self._ended.add(client)
            leases = self._leases.pop_client(client)
            for lease in leases:
                self._end_lease(lease)
            for lease_id in self._leases.quarantined_ids(client):
                self._free_quarantined(lease_id)
            self._prefetches.release_client(client)
            return len(leases)

    def expire_leases(self, cutoff: float) -> int:
        """End the leases taken at or before ``cutoff`` (monotonic); expired
        write leases are quarantined (module docstring). The number expired."""
        with self._lock:
            old = self._leases.pop_older_than(cutoff)
            for lease in old:
                if lease.write:
                    self._leases.quarantine(lease)
                    self._abort_entry(lease.entry, keep_pinned=True)
                else:
                    self._end_lease(lease)
            self._counters.leases_expired_total += len(old)
            return len(old)

    def client_write_bytes(self, client: str) -> int:
        """Arena bytes under ``client``'s write leases and quarantined slots."""
        with self._lock:
            return self._leases.held_bytes(client)

    def lease_counts(self) -> dict[str, int]:
        """Leases held per client."""
        with self._lock:
            return self._leases.counts()

    # -- prefetch
    def plan_prefetch(
        self, keys: Sequence[ChunkKey], owner: str, below: Callable[[ChunkKey], bool]
    ) -> tuple[int, list[ChunkKey]]:
        """(chunks pinned now or scheduled, keys to fetch in the background): a
        READY chunk is leased now, a key L1 lacks is fetched if ``below(key)``
        (a lower tier may hold it), else the plan stops. Keys ``owner`` holds
        or is fetching already count as pinned, not leased again."""
        scheduled, fresh = 0, 0
        to_fetch: list[ChunkKey] = []
        leased: list[Entry] = []
        with self._lock:
            if self._closed or self._ended.has_owner(owner):
                return 0, []
            pinned = self._leases.read_keys(owner) | self._prefetches.in_flight(owner)
            for key in keys:
                if key in pinned:
                    scheduled += 1
                    continue
                entry = self._store.entries.get(key)
                if entry is not None and entry.state == READY:
                    self._read_lease(entry, owner, prefetch=True)
                    leased.append(entry)
                elif entry is not None or below(key):
                    to_fetch.append(key)
                else:
                    break
                fresh += 1
                scheduled += 1
            self._counters.prefetch_chunks_total += fresh
            if to_fetch:
                self._prefetches.expect(owner, to_fetch)
        for entry in leased:
            self._listener.read(entry)
        return scheduled, to_fetch

    def prefetch_landed(self, owner: str, key: ChunkKey, slot: Slot | None) -> None:
        """A prefetch job of ``owner`` for ``key`` ended with ``slot`` (None:
        nothing leased); its lease ends at once if the owner was released."""
        with self._lock:
            if self._prefetches.landed(owner, key) and slot is not None:
                self._pop_lease(slot.lease_id)

    # -- write-behind's steps (see :mod:`.writeback`)
    def pin_current(self, entry: Entry, pin: bool = True) -> bool:
        """Whether ``entry`` is still in the index; pinned (``pin``) for a copy below L1."""
        with self._lock:
            if self._store.entries.get(entry.key) is not entry:
                return False
            if pin:
                entry.pins += 1
            return True

    def unpin(self, entry: Entry) -> None:
        """End a pin of :meth:`pin_current` (the entry is freed if it was its last)."""
        with self._lock:
            self._store.unpin(entry)

    def l2_holds(self, tenant: str, key: ChunkKey, age: float = 0.0) -> None:
        """L2 holds ``key`` of ``tenant``, written ``age`` seconds ago (its TTL
        age, where its tenant has a TTL: :meth:`L1Store.expire` drops both)."""
        with self._lock:
            self._store.tenants.stored("l2", tenant, key, self._store.now() - age)

    def yield_to_shared(self, entry: Entry) -> None:
        """The shared tier held ``entry``'s key already: ``entry`` leaves, counted."""
        with self._lock:
            entry.yielded = True
            if self._store.entries.get(entry.key) is entry:
                self._store.remove(entry.key)
            self._counters.shared_already_held_total += 1

    # -- maintenance
    def expire_ttl(self) -> list[ChunkKey]:
        """Drop chunks older than their tenant's TTL; the keys to remove from L2."""
        if not self._store.tenants.rules.ttl_tenants:
            return []
        with self._lock:
            return self._store.expire()

    def remove(self, key: ChunkKey) -> None:
        """Forget ``key`` (freed once no lease pins it)."""
        with self._lock:
            self._store.remove(key)

    def clear(self) -> None:
        """Forget every chunk (each freed once no lease pins it)."""
        with self._lock:
            for key in list(self._store.entries):
                self._store.remove(key)

    def record_events(self, events: TierEvents) -> bool:
        """Tell ``events`` what arrives in and leaves L1; False if already told."""
        with self._lock:
            if self._store.events is not None:
                return False
            self._store.events = events
            return True

    def close(self) -> bool:
        """No prefetch starts from now on; False when already closed."""
        with self._lock:
            was_open, self._closed = not self._closed, True
        return was_open

    def snapshot(self) -> EngineStats:
        """L1's figures, the counters and the index's gauges at one moment
        (the engine adds the tiers below L1 and write-behind's gauges)."""
        with self._lock:
            store, counters = self._store, self._counters
            l1 = TierStats(
                tier="l1",
                usage_bytes=store.allocator.used_bytes,
                capacity_bytes=store.capacity,
                objects=len(store.entries),
                stored_bytes_total=counters.stored_bytes_total,
                retrieved_bytes_total=counters.retrieved_bytes_total,
                hits_total=counters.hits_total,
                misses_total=counters.misses_total,
                evictions_total=store.evictions_total,
                young_evictions_total=store.young_evictions_total,
            )
            gauges = EngineGauges(
                leases_active=len(self._leases),
                quarantined_bytes=self._leases.quarantined_total,
                l1_free_largest_bytes=store.allocator.largest_free,
                queued_loads=self._prefetches.queued(),
            )
            return EngineStats({"l1": l1}, counters.copy(), gauges, store.tenants.snapshot())

    # -- under the lock
    def _read_local(
        self, key: ChunkKey, owner: str, prefetch: bool
    ) -> tuple[Slot, Entry] | tuple[None, None]:
        """(a read lease, its entry) if L1 holds ``key`` READY, waiting for a promotion
        of it under way (at most PROMOTION_WAIT_SECONDS). The caller checked that
        ``owner``'s client has not ended; checked again after a wait (lock released)."""
        deadline = time.monotonic() + PROMOTION_WAIT_SECONDS
        waited = False
        while True:
            entry = self._store.entries.get(key)
            if entry is None:
                return None, None
            if entry.state == READY:
                if waited and self._ended.has_owner(owner):  # it ended meanwhile
                    return None, None
                return self._read_lease(entry, owner, prefetch), entry
            if not entry.promoting:
                return None, None  # a client is still writing it: a miss for now
            left = deadline - time.monotonic()
            if left <= 0:
                return None, None
            self._cond.wait(left)
            waited = True

    def _read_lease(self, entry: Entry, owner: str, prefetch: bool) -> Slot:
        """A read lease on READY ``entry`` (a prefetch's is no hit: its read is)."""
        entry.pins += 1
        self._store.policy.on_access(entry.key)
        if prefetch:
            self._counters.prefetched_bytes_total += entry.length
        else:
            self._counters.hits_total += 1
            self._counters.retrieved_bytes_total += entry.length
        return self._leases.new(entry, owner, write=False)

    def _tell_then_unpin(self, entry: Entry, promoted_from: str | None) -> None:
        """Tell the listener of a commit (of a promotion from ``promoted_from``),
        then end the pin that kept ``entry`` from eviction meanwhile."""
        try:
            if promoted_from is None:
                self._listener.stored(entry)
            else:
                self._listener.promoted(entry, promoted_from)
                self._listener.read(entry)
        finally:
            with self._lock:
                self._store.unpin(entry)

    def _end_lease(self, lease: Lease) -> None:
        """Undo one lease (a write lease aborts its entry)."""
        if lease.write:
            self._abort_entry(lease.entry)
        else:
            self._store.unpin(lease.entry)

    def _pop_lease(self, lease_id: int) -> None:
        lease = self._leases.pop(lease_id)
        if lease is not None:
            self._end_lease(lease)

    def _abort_entry(self, entry: Entry, keep_pinned: bool = False) -> None:
        """:meth:`L1Store.abort`, waking readers waiting for its promotion."""
        self._store.abort(entry, keep_pinned)
        self._cond.notify_all()

    def _free_quarantined(self, lease_id: int, client: str | None = None) -> bool:
        """Unpin the quarantined slot of ``lease_id``; False if none (of ``client``)."""
        lease = self._leases.unquarantine(lease_id, client)
        if lease is None:
            return False
        self._store.unpin(lease.entry)
        return True
