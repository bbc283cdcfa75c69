"""The tiered storage engine of one sidecar: L1 arena, L2 disk, shared tier.

Why one object: the server needs a single thread-safe facade that answers
"how much of this prefix do we have", hands out leased arena slots for the
client to copy into or out of, and moves chunks between tiers behind the
scenes. The pieces live elsewhere: :mod:`~kvstrata.sidecar.arena` (the
segment), :mod:`~kvstrata.sidecar.l1` (index, allocator, policy),
:mod:`~kvstrata.sidecar.leases` (who holds which slot),
:mod:`~kvstrata.sidecar.lookup` (the prefix walk),
:mod:`~kvstrata.sidecar.writeback` (copies down, and what they pin),
:mod:`~kvstrata.sidecar.promotion` (copies a chunk up into L1 from L2 or
the shared tier; the engine holds a
:class:`~kvstrata.sidecar.promotion.Promotion` and hands it its index steps),
:mod:`~kvstrata.sidecar.prefetch` (background promotions),
:mod:`~kvstrata.sidecar.partials` (chunks of fewer blocks than a full one),
:mod:`~kvstrata.sidecar.journal` (the tiers' changes, for EVENTS),
:mod:`~kvstrata.sidecar.tiers.disk` (L2) and any shared :class:`Tier`.

Data flow:

* ``reserve`` -> client writes into the slot -> ``commit``: the chunk is
  visible in L1 and handed to write-behind (into L2 and, per
  ``shared.admission``, the shared tier).
* ``lookup``: the longest prefix present in L1, then L2, then the shared tier.
* ``acquire``: a read lease on the L1 object; an L2 or shared hit is
  promoted into L1 first (L2 reads straight into the reserved slot).
* ``prefetch``: the same promotion on background threads; the chunks stay
  pinned under leases of ``owner`` until ``release_owner`` (which also ends
  the leases of prefetches still on their way when it is called). One owner
  holds at most one prefetch lease per chunk, however often it asks.

Leases: every slot handed out is a lease (read or write) with an id that
is never reused. A leased object is never evicted or freed. Leases end by
``release``/``commit``/``abort``, ``release_owner``, ``release_client`` or
``expire_leases``. A client released by ``release_client`` has ended (its
session is gone): it gets no lease after that, so a request still running
for it (a long PREPARE_RETRIEVE promoting from L2) stops taking leases
instead of pinning L1 for no one until they expire.

An expired *write* lease is taken out of the index at once, but its slot
stays pinned (quarantined) until its writer says it is done with it (a
COMMIT_STORE or RELEASE naming it, refused) or its client ends (also when
it is reclaimed after ``server.client_timeout_seconds`` of silence): a writer
that reached its copy late (a starved thread, a stopped process) would
otherwise write into a slot that another chunk owns by then, changing that
chunk silently. A quarantined slot still counts against its client's write
budget (:meth:`StorageManager.client_write_bytes`), and the server caps one
chunk at ``server.chunk_max_fraction`` of the arena: a client that goes
silent holding an expired lease keeps at most its own share of L1 pinned,
and everyone else's stores and promotions go on in the rest. Read leases
expire outright: a late reader checks its own copy against the lease's time
(``connector/lease_clock.py``).

Locking: one lock guards the index, leases, counters, write-behind's and
prefetch's state; it is never held during a copy or any I/O. Lookup,
write-behind and prefetch share it (each module says why); promotion does
not see it: it gets the engine's steps on the index as callables. L2 is asked
through its tier interface (L2's own lock, taken inside ours, never the
other way round).

No state is persisted here; L2 persists its own files.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from kvstrata.sidecar.arena import Arena, owner_prefix
from kvstrata.sidecar.config import SidecarConfig
from kvstrata.sidecar.journal import EventJournal
from kvstrata.sidecar.keys import ChunkKey
from kvstrata.sidecar.l1 import READY, Entry, L1Store
from kvstrata.sidecar.leases import Lease, LeaseTable, Slot, client_of
from kvstrata.sidecar.lookup import LookupResult, PrefixLookup
from kvstrata.sidecar.objformat import ChunkMeta
from kvstrata.sidecar.partials import blocks_match, entry_is_partial, is_partial
from kvstrata.sidecar.prefetch import Prefetcher
from kvstrata.sidecar.promotion import IndexSteps, Promotion
from kvstrata.sidecar.tenants import TenantRules, TenantSnapshot, l2_shares, with_tier
from kvstrata.sidecar.tierchoice import TierChoice
from kvstrata.sidecar.tiers.base import Tier, TierStats
from kvstrata.sidecar.tiers.disk import DiskTier
from kvstrata.sidecar.writeback import WriteBehind

if TYPE_CHECKING:
    from kvstrata.sidecar.sealing import KeyRing

__all__ = ["EngineStats", "LookupResult", "StorageManager"]

logger = logging.getLogger(__name__)

ENGINE_OWNER = "engine"
PROMOTION_WAIT_SECONDS = 5.0
# Ended clients remembered (session ids are random and never reused; a
# request for one ended longer ago than this many endings is long gone).
MAX_ENDED_CLIENTS = 16384


@dataclass
class EngineStats:
    """A snapshot for metrics: per-tier stats and engine counters (base units)."""

    tiers: dict[str, TierStats]
    counters: dict[str, int] = field(default_factory=dict)
    tenants: TenantSnapshot = field(default_factory=TenantSnapshot)


class StorageManager:
    """L1 + L2 + shared tier behind one thread-safe API (module docstring)."""

    def __init__(
        self,
        config: SidecarConfig,
        shared_tier: Tier | None = None,
        clock: Callable[[], float] = time.monotonic,
        keys: KeyRing | None = None,
    ) -> None:
        """``clock``: what tenants' TTLs are measured with (a test's own)."""
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
            tenants=TenantRules(config.tenants, shared_tier is None or shared_tier.expires_per_key),
            clock=clock,
            young_seconds=config.young_eviction_seconds,
        )
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._leases = LeaseTable()
        self._ended: OrderedDict[str, None] = OrderedDict()  # see release_client
        self._counters: dict[str, int] = {}
        self._hits = self._misses = self._stored_bytes = self._retrieved_bytes = 0
        self._prefetched_bytes = 0
        self.l2: DiskTier | None = None
        self.shared = shared_tier
        try:
            if config.l2.enabled:
                self.l2 = DiskTier(
                    config.l2.path,
                    config.l2.size_bytes,
                    namespace_quota=config.l2.namespace_quota_bytes,
                    direct=config.l2.direct_io,
                    keys=keys,
                    young_seconds=config.young_eviction_seconds,
                    tenants=l2_shares(config.tenants),
                )
                self._adopt_l2_ages(self.l2)
            self._wb = WriteBehind(
                config, self.arena, self._store, self._lock, self._count, self.l2, shared_tier
            )
        except BaseException:
            self.arena.close()
            raise
        self._promotion = Promotion(
            self._buf,
            self.l2,
            shared_tier,
            IndexSteps(
                reserve=self._reserve_promotion,
                publish=self._publish_promotion,
                fail=self._fail_promotion,
            ),
        )
        self._lookup = PrefixLookup(self._lock, self._store, self.l2, shared_tier, self._count)
        # A prefetch's lease only pins a chunk ahead of the read that follows
        # (PREPARE_RETRIEVE takes its own lease): counted apart, so that
        # retrieved bytes and hits count each read once.
        self._prefetcher = Prefetcher(
            self._cond,
            lambda key, owner, tiers: self._acquire(key, owner, prefetch=True, tiers=tiers),
            self._pop_lease,
        )
        self.journal = EventJournal()
        self._closed = False

    def _adopt_l2_ages(self, l2: DiskTier) -> None:
        """Files found in L2 at start whose (sealed) header names a tenant with
        a TTL age from when they were written: a restart does not make them new."""
        ledger = self._store.tenants
        ttl_tenants = ledger.rules.ttl_tenants
        if not ttl_tenants:
            return
        now, wall = self._store.now(), time.time()
        for key, tenant, written in l2.tenant_files(ttl_tenants):
            ledger.stored("l2", tenant, ChunkKey(key), now - max(0.0, wall - written))

    def record_events(self) -> None:
        """Every tier tells the journal what arrives and leaves from now on (idempotent;
        off until a client asks: with no reader, recording is pure cost on the store path)."""
        with self._lock:
            if self._store.events is None:
                self._store.events = self.journal.for_tier("l1")
                if self.l2 is not None:
                    self.l2.events = self.journal.for_tier(self.l2.name)
                if self.shared is not None:
                    self._wb.tell_shared_writes(self.journal.for_tier(self.shared.name))

    # -- counters -----------------------------------------------------------

    def _count(self, name: str, n: int = 1) -> None:
        self._counters[name] = self._counters.get(name, 0) + n

    def _in_l2(self, key: ChunkKey) -> bool:
        return self.l2 is not None and self.l2.contains(key)

    # -- lookup -------------------------------------------------------------

    def lookup(
        self, keys: Sequence[ChunkKey], fetch_ahead: bool = False, tiers: TierChoice = None
    ) -> LookupResult:
        """Longest contiguous prefix of ``keys`` present in any tier of ``tiers``
        (``fetch_ahead``: a prefetch of it follows; see :meth:`PrefixLookup.lookup`)."""
        self.expire()
        return self._lookup.lookup(keys, fetch_ahead, tiers)

    def expire(self) -> None:
        """Remove the chunks older than their tenant's TTL from L1 and L2 (a
        read then misses). Run before every lookup and read."""
        if self._store.tenants.rules.ttl_tenants:
            with self._lock:
                old_l2 = self._store.expire()
            for key in old_l2 if self.l2 is not None else ():
                self.l2.remove(key)  # file I/O: never under the lock

    def lookup_partial(
        self, candidates: Sequence[ChunkKey], tiers: TierChoice = None
    ) -> tuple[int, str] | None:
        """(index, tier) of the first of ``candidates`` some tier of ``tiers`` holds
        (see :mod:`.partials`); None when none is held."""
        found = self._lookup.first_present(candidates, tiers)
        if found is not None:
            with self._lock:
                self._count("partial_hits_total")
        return found

    def drop_partials(self, keys: Sequence[ChunkKey], replaced: bool) -> int:
        """Remove from every tier those of ``keys`` held as partial chunks in
        L1 or L2 (a longer partial or the full chunk supersedes them); counted
        as replaced (``replaced``) or dropped. The number removed."""
        with self._lock:
            found = [k for k in keys if entry_is_partial(self._store.entries.get(k))]
        if self.l2 is not None:
            found += [k for k in keys if k not in found and is_partial(self._l2_meta(k))]
        for key in found:
            self.remove(key)
        if found:
            with self._lock:
                self._count(
                    "partial_replaced_total" if replaced else "partial_dropped_total", len(found)
                )
        return len(found)

    def _l2_meta(self, key: ChunkKey) -> ChunkMeta | None:
        info = self.l2.peek(key) if self.l2 is not None else None
        return None if info is None else info.meta

    # -- leases -------------------------------------------------------------

    def _end_lease(self, lease: Lease) -> None:
        """Caller holds the lock; undoes one lease (a write lease aborts)."""
        entry = lease.entry
        if lease.write:
            self._abort_entry(entry)
        else:
            self._store.unpin(entry)

    def _pop_lease(self, lease_id: int) -> None:
        """Caller holds the lock: end lease ``lease_id`` if it still exists."""
        lease = self._leases.pop(lease_id)
        if lease is not None:
            self._end_lease(lease)

    def _abort_entry(self, entry: Entry, keep_pinned: bool = False) -> None:
        """Caller holds the lock: take an unpublished entry out of the index;
        its extent is freed at its last unpin (``keep_pinned``: the writer's
        pin stays, see :meth:`_quarantine`)."""
        if self._store.entries.get(entry.key) is entry:
            self._store.remove(entry.key)
        else:
            entry.dead = True
        entry.promoting = False
        if not keep_pinned:
            self._store.unpin(entry)
        self._cond.notify_all()

    def _read_lease(self, entry: Entry, owner: str, prefetch: bool = False) -> Slot:
        """Caller holds the lock (and calls ``self._wb.submit()`` after it).
        A ``prefetch`` lease is counted as prefetched bytes, not as a hit:
        the read that follows it is the hit."""
        entry.pins += 1
        self._store.policy.on_access(entry.key)
        if prefetch:
            self._prefetched_bytes += entry.length
        else:
            self._hits += 1
            self._retrieved_bytes += entry.length
        self._wb.read(entry)
        return self._leases.new(entry, owner, write=False)

    # -- store --------------------------------------------------------------

    def reserve(
        self,
        key: ChunkKey,
        nbytes: int,
        meta: ChunkMeta,
        owner: str,
        parent: ChunkKey | None = None,
        store_tiers: TierChoice = None,
    ) -> Slot | None:
        """A write lease on fresh arena space for ``key`` (evicting as needed);
        write-behind copies it only into ``store_tiers`` (None: every tier).

        None when ``key`` is already held (see :meth:`_held_below`; in L1
        being written or stored) or nothing evictable frees enough contiguous
        space. ``parent`` is the previous chunk of the same prompt, for
        prefix-aware eviction.
        """
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        with self._lock:
            if key in self._store.entries or self._held_below(key):
                self._count("store_deduplicated_total")
                return None
            if client_of(owner) in self._ended:
                return None
            entry = self._store.reserve(key, nbytes, replace(meta, store_tiers=store_tiers), parent)
            if entry is None:
                self._count("store_rejected_total")
                return None
            return self._leases.new(entry, owner, write=True)

    def _held_below(self, key: ChunkKey) -> bool:
        """Caller holds the lock: whether L2 holds ``key``. Keys name content:
        a tier that holds a key answers a store of it as already stored, so
        that no two tiers hold different bytes under one key. L2's index is
        in memory, so a store never waits on the disk. The shared tier is not
        asked here (a network round trip on every PREPARE_STORE, and the keys
        this sidecar saw there may have expired since): its upload finds an
        object already there, and this sidecar's copies yield to it then
        (:mod:`.writeback`)."""
        return self._in_l2(key)

    def supersede(self, slot: Slot, covers: Sequence[ChunkKey]) -> None:
        """The chunk being written into ``slot`` supersedes the partial chunks
        ``covers``: once it is in the shared tier they are deleted there too
        (whoever wrote them; see :mod:`.partials`). An ended lease is ignored."""
        with self._lock:
            lease = self._leases.get(slot.lease_id)
            if lease is not None and lease.write:
                lease.entry.supersedes = tuple(covers)

    def commit(self, slot: Slot) -> bool:
        """The slot's bytes are written: publish the chunk and queue it below."""
        return self.commit_lease(slot.lease_id)

    def abort(self, slot: Slot) -> None:
        """Discard a reservation (unknown or already ended leases are ignored)."""
        self.commit_lease(slot.lease_id, ok=False)

    def commit_lease(self, lease_id: int, ok: bool = True, client: str | None = None) -> bool:
        """Commit (``ok``) or abort the write lease ``lease_id``; True when
        committed. A lease that is unknown, a read lease or (with ``client``)
        another client's is left as it is, and the answer is False."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None and self._free_quarantined(lease_id, client):
                return False  # it expired before: its writer is done now
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
            self._stored_bytes += entry.length
            if is_partial(entry.meta):
                self._count("partial_stored_total")
            self._wb.stored(entry)
            self._store.unpin(entry)
        self._wb.submit()
        return True

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

    # -- retrieve -----------------------------------------------------------

    def acquire(
        self, key: ChunkKey, owner: str, blocks: int | None = None, tiers: TierChoice = None
    ) -> Slot | None:
        """A read lease on ``key``, promoting it from L2 or the shared tier
        into L1 when needed (synchronously, within the tiers' deadlines).
        None is a miss; so is an object whose block count (its header's) is
        not ``blocks`` when given (0: a full chunk; see :mod:`.partials`).
        ``tiers``: the only tiers below L1 it may be promoted from (the
        request's load tiers; None: every tier). A chunk already in L1 is
        served whatever they say: every load lands there first."""
        slot = self._acquire(key, owner, tiers=tiers)
        if slot is not None and self._drop_if_ended(slot, owner):
            return None
        if slot is None or blocks is None or blocks_match(slot.meta, blocks):
            return slot
        self.release(slot)
        with self._lock:
            self._count("partial_mismatch_total")
        return None

    def _drop_if_ended(self, slot: Slot, owner: str) -> bool:
        """End ``slot``'s lease when its client ended while it was being taken
        (``release_client`` ran between the lease and now); True if so."""
        with self._lock:
            if client_of(owner) not in self._ended:
                return False
            self._pop_lease(slot.lease_id)
            return True

    def client_ended(self, client: str) -> bool:
        """Whether ``release_client(client)`` was called: its session is gone."""
        with self._lock:
            return client in self._ended

    def _acquire(
        self, key: ChunkKey, owner: str, prefetch: bool = False, tiers: TierChoice = None
    ) -> Slot | None:
        self.expire()
        with self._lock:
            if client_of(owner) in self._ended:
                return None  # no promotion I/O for a client that is gone
            slot = self._acquire_local(key, owner, prefetch)
            if slot is None and key not in self._store.entries and not prefetch:
                self._misses += 1
        self._wb.submit()
        if slot is not None or key in self._store.entries:
            return slot
        return self._promotion.promote(key, owner, prefetch, tiers)

    def _acquire_local(self, key: ChunkKey, owner: str, prefetch: bool = False) -> Slot | None:
        """Caller holds the lock. Waits for an in-flight promotion of ``key``."""
        deadline = time.monotonic() + PROMOTION_WAIT_SECONDS
        while True:
            entry = self._store.entries.get(key)
            if entry is None:
                return None
            if entry.state == READY:
                return self._read_lease(entry, owner, prefetch)
            if not entry.promoting:
                return None  # a client is still writing it: a miss for now
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self._cond.wait(left)

    # -- promotion's steps on the index (see :mod:`.promotion`) ---------------

    def _reserve_promotion(
        self, key: ChunkKey, nbytes: int, meta: ChunkMeta, owner: str, prefetch: bool
    ) -> tuple[Entry | None, Slot | None]:
        """(entry to fill, None) or (None, a read lease when it appeared meanwhile)."""
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
            slot = self._acquire_local(key, owner, prefetch)
        self._wb.submit()
        return None, slot

    def _publish_promotion(
        self, entry: Entry, meta: ChunkMeta, owner: str, tier: str, prefetch: bool
    ) -> Slot | None:
        with self._lock:
            entry.promoting = False
            self._cond.notify_all()
            # The storing request's tier choice stays with the chunk: L2's index
            # kept it (in the reserved meta); for the shared tier, the
            # write-behind remembers what it uploaded.
            choice = entry.meta.store_tiers
            if tier != "l2":
                choice = self._wb.shared_choice(entry.key)
                self._wb.note_shared(entry.key, choice)
            if entry.dead:
                self._store.unpin(entry)
                return None
            # The tenant is the one the reservation was charged to (from L2's
            # index or the sealed header the place callback saw).
            entry.meta = replace(meta, tenant=entry.meta.tenant, store_tiers=choice)
            self._store.publish(entry)
            self._count(f"promotions_total_{tier}")
            self._wb.promoted(entry, tier)
            slot = self._read_lease(entry, owner, prefetch)
            self._store.unpin(entry)  # the fill pin; the read lease keeps its own
        self._wb.submit()
        return slot

    def _fail_promotion(self, entry: Entry) -> None:
        with self._lock:
            self._count("promotion_failed_total")
            self._abort_entry(entry)

    def release(self, slot: Slot) -> None:
        """End a read lease."""
        self.release_lease(slot.lease_id)

    def release_lease(self, lease_id: int, client: str | None = None) -> bool:
        """End a lease by id (a write lease is aborted); False if unknown or
        (with ``client``) another client's."""
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
            self._prefetcher.owner_released(owner)
            return len(leases)

    def release_client(self, client: str) -> int:
        """End every lease of ``client`` (see :mod:`.leases`); the number ended.
        Its prefetches still running end their leases as soon as they land,
        and the client gets no lease from now on: it has ended."""
        with self._lock:
            self._ended[client] = None
            if len(self._ended) > MAX_ENDED_CLIENTS:
                self._ended.popitem(last=False)
            leases = self._leases.pop_client(client)
            for lease in leases:
                self._end_lease(lease)
            for lease_id in self._leases.quarantined_ids(client):
                self._free_quarantined(lease_id)
            self._prefetcher.client_released(client)
            return len(leases)

    def client_write_bytes(self, client: str) -> int:
        """Arena bytes ``client`` holds for writing: its uncommitted write
        leases and its quarantined slots (expired leases whose writer has not
        said it is done), so an expired lease still counts against its client."""
        with self._lock:
            return self._leases.held_bytes(client)

    def lease_counts(self) -> dict[str, int]:
        """Leases held per client."""
        with self._lock:
            return self._leases.counts()

    def expire_leases(self, now: float | None = None) -> int:
        """End leases older than ``server.lease_seconds`` (``now``: monotonic)."""
        now = time.monotonic() if now is None else now
        cutoff = now - self.config.server.lease_seconds
        with self._lock:
            old = self._leases.pop_older_than(cutoff)
            for lease in old:
                if lease.write:
                    self._quarantine(lease)
                else:
                    self._end_lease(lease)
            self._count("leases_expired_total", len(old))
            return len(old)

    def _quarantine(self, lease: Lease) -> None:
        """Caller holds the lock: abort an expired write lease, keeping its slot
        pinned until :meth:`_free_quarantined` (module docstring)."""
        self._leases.quarantine(lease)
        self._abort_entry(lease.entry, keep_pinned=True)

    def _free_quarantined(self, lease_id: int, client: str | None = None) -> bool:
        """Caller holds the lock: unpin the quarantined slot of ``lease_id``
        (its writer is done with it); False if there is none (of ``client``)."""
        lease = self._leases.unquarantine(lease_id, client)
        if lease is None:
            return False
        self._store.unpin(lease.entry)
        return True

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

    def prefetch(self, keys: Sequence[ChunkKey], owner: str, tiers: TierChoice = None) -> int:
        """Bring ``keys`` into L1 in the background, pinned under leases of
        ``owner``; the number of chunks pinned now or scheduled. Stops at the
        first key no local index knows unless a shared tier may have it.
        Keys ``owner`` already holds a read lease on, or is prefetching, are
        counted as pinned and not leased again. ``tiers``: as :meth:`acquire`'s."""
        scheduled = 0
        to_fetch: list[ChunkKey] = []
        with self._lock:
            if self._closed or client_of(owner) in self._ended:
                return 0
            pinned = self._leases.read_keys(owner) | self._prefetcher.in_flight(owner)
            fresh = 0
            for key in keys:
                if key in pinned:
                    scheduled += 1
                    continue
                entry = self._store.entries.get(key)
                if entry is not None and entry.state == READY:
                    self._read_lease(entry, owner, prefetch=True)
                elif entry is not None or self.shared is not None or self._in_l2(key):
                    to_fetch.append(key)
                else:
                    break
                fresh += 1
                scheduled += 1
            self._count("prefetch_chunks_total", fresh)
            if to_fetch:
                self._prefetcher.expect(owner, to_fetch)
        self._wb.submit()
        self._prefetcher.start(to_fetch, owner, tiers)
        return scheduled

    # -- maintenance --------------------------------------------------------

    def remove(self, key: ChunkKey) -> None:
        """Forget ``key`` in every tier (L1 frees it once no lease pins it)."""
        with self._lock:
            self._store.remove(key)
            self._wb.forget(key)
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
            self._wb.forget_all()
        if self.l2 is not None:
            self.l2.clear()
        if shared and self.shared is not None:
            self.shared.clear()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for prefetches and write-behind queues; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        if not self._prefetcher.wait(left()):
            return False
        return self._wb.flush(left)

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
                young_evictions_total=store.young_evictions_total,
            )
            counters = dict(self._counters)
            counters["leases_active"] = len(self._leases)
            counters["quarantined_bytes"] = self._leases.quarantined_total
            counters["writeback_pinned_bytes"] = self._wb.pinned
            counters["writeback_backlog"] = self._wb.backlog
            counters["l1_free_largest_bytes"] = store.allocator.largest_free
            counters["prefetched_bytes_total"] = self._prefetched_bytes
            tenants = store.tenants.snapshot()
            counters["queued_loads"] = self._prefetcher.queued()
        if self.l2 is not None:
            tenants = with_tier(tenants, "l2", self.l2.tenant_figures())
        tiers = {"l1": l1}
        for tier in (self.l2, self.shared):
            if tier is not None:
                tiers[tier.name] = self._wb.tier_stats(tier.stats())
        return EngineStats(tiers=tiers, counters=counters, tenants=tenants)

    def close(self) -> None:
        """Stop threads and unlink the shared-memory segment."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._prefetcher.close()
        self._wb.close()
        if self.l2 is not None:
            self.l2.close()
        self.arena.close()

    def __enter__(self) -> StorageManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
