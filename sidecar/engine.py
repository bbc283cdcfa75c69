"""The tiered storage engine of one sidecar: L1 arena, L2 disk, shared tier.

Why one object: the server needs a single thread-safe facade that answers
"how much of this prefix do we have", hands out leased arena slots for the
client to copy into or out of, and moves chunks between tiers behind the
scenes. It only orchestrates (lookup -> promotion -> prefetch ->
write-behind -> tiers) and holds no lock; the state lives in its parts:
:mod:`~kvstrata.sidecar.arena` (the segment),
:mod:`~kvstrata.sidecar.l1index` (the one owner of the L1 store, the leases
and their lock, the ended clients and the engine's counters),
:mod:`~kvstrata.sidecar.lookup` (the prefix walk),
:mod:`~kvstrata.sidecar.writeback` (copies down, and what they pin),
:mod:`~kvstrata.sidecar.promotion` (a read lease, copying a chunk up into L1
from L2 or the shared tier when needed),
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

Leases end by ``release``/``commit``/``abort``, ``release_owner``,
``release_client`` or ``expire_leases``; a client released by
``release_client`` has ended and gets no lease after that. An expired write
lease's slot stays pinned (quarantined) until its writer says it is done or
its client ends, and still counts against its client's write budget
(:meth:`StorageManager.client_write_bytes`); the server caps one chunk at
``server.chunk_max_fraction`` of the arena, so a client that goes silent
holding an expired lease keeps at most its own share of L1 pinned. The
rules and their reasons are :mod:`~kvstrata.sidecar.l1index`'s.

No state is persisted here; L2 persists its own files.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from kvstrata.sidecar.arena import Arena, owner_prefix
from kvstrata.sidecar.config import SidecarConfig
from kvstrata.sidecar.counters import EngineStats
from kvstrata.sidecar.journal import EventJournal
from kvstrata.sidecar.keys import ChunkKey
from kvstrata.sidecar.l1 import L1Store
from kvstrata.sidecar.l1index import L1Index
from kvstrata.sidecar.leases import Slot
from kvstrata.sidecar.lookup import LookupResult, PrefixLookup
from kvstrata.sidecar.objformat import ChunkMeta
from kvstrata.sidecar.partials import blocks_match, is_partial
from kvstrata.sidecar.prefetch import Prefetcher
from kvstrata.sidecar.promotion import Promotion
from kvstrata.sidecar.tenants import TenantRules, l2_shares, with_tier
from kvstrata.sidecar.tierchoice import TierChoice
from kvstrata.sidecar.tiers.base import Tier
from kvstrata.sidecar.tiers.disk import DiskTier
from kvstrata.sidecar.writeback import WriteBehind

if TYPE_CHECKING:
    from kvstrata.sidecar.sealing import KeyRing

__all__ = ["EngineStats", "LookupResult", "StorageManager"]

logger = logging.getLogger(__name__)

ENGINE_OWNER = "engine"


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
        rules = TenantRules(config.tenants, shared_tier is None or shared_tier.expires_per_key)
        self._index = L1Index(self._l1_store(rules, clock))
        self.l2: DiskTier | None = None
        self.shared = shared_tier
        try:
            self.l2 = self._open_l2(rules, keys)
            self._wb = WriteBehind(config, self.arena, self._index, rules, self.l2, shared_tier)
        except BaseException:
            self.arena.close()
            raise
        self._index.listen(self._wb)
        self._promotion = Promotion(self._index, self._buf, self.l2, shared_tier)
        self._lookup = PrefixLookup(self._index, self.l2, shared_tier)
        self._prefetcher = Prefetcher(self._index, self._promotion)
        self.journal = EventJournal()

    def _l1_store(self, rules: TenantRules, clock: Callable[[], float]) -> L1Store:
        l1 = self.config.l1
        return L1Store(
            self.arena.size,
            l1.policy,
            l1.prefix_aware,
            namespace_quota=l1.namespace_quota_bytes,
            tenants=rules,
            clock=clock,
            young_seconds=self.config.young_eviction_seconds,
        )

    def _open_l2(self, rules: TenantRules, keys: KeyRing | None) -> DiskTier | None:
        """L2 when enabled, with the TTL ages of the files found in it."""
        config = self.config
        if not config.l2.enabled:
            return None
        l2 = DiskTier(
            config.l2.path,
            config.l2.size_bytes,
            namespace_quota=config.l2.namespace_quota_bytes,
            direct=config.l2.direct_io,
            keys=keys,
            young_seconds=config.young_eviction_seconds,
            tenants=l2_shares(config.tenants),
        )
        # Files whose (sealed) header names a tenant with a TTL keep the age
        # they had when written: a restart does not make them new.
        if rules.ttl_tenants:
            wall = time.time()
            for key, tenant, written in l2.tenant_files(rules.ttl_tenants):
                self._index.l2_holds(tenant, ChunkKey(key), max(0.0, wall - written))
        return l2

    def record_events(self) -> None:
        """Every tier tells the journal what arrives and leaves from now on (idempotent;
        off until a client asks: with no reader, recording is pure cost on the store path)."""
        if self._index.record_events(self.journal.for_tier("l1")):
            if self.l2 is not None:
                self.l2.events = self.journal.for_tier(self.l2.name)
            if self.shared is not None:
                self._wb.tell_shared_writes(self.journal.for_tier(self.shared.name))

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
        self._promotion.expire()

    def lookup_partial(
        self, candidates: Sequence[ChunkKey], tiers: TierChoice = None
    ) -> tuple[int, str] | None:
        """(index, tier) of the first of ``candidates`` some tier of ``tiers`` holds
        (see :mod:`.partials`); None when none is held."""
        found = self._lookup.first_present(candidates, tiers)
        if found is not None:
            with self._index.tally() as counts:
                counts.partial_hits_total += 1
        return found

    def drop_partials(self, keys: Sequence[ChunkKey], replaced: bool) -> int:
        """Remove from every tier those of ``keys`` held as partial chunks in
        L1 or L2 (a longer partial or the full chunk supersedes them); counted
        as replaced (``replaced``) or dropped. The number removed."""
        found = self._index.partial_keys(keys)
        if self.l2 is not None:
            found += [k for k in keys if k not in found and is_partial(self._l2_meta(k))]
        for key in found:
            self.remove(key)
        if found:
            with self._index.tally() as counts:
                if replaced:
                    counts.partial_replaced_total += len(found)
                else:
                    counts.partial_dropped_total += len(found)
        return len(found)

    def _l2_meta(self, key: ChunkKey) -> ChunkMeta | None:
        info = self.l2.peek(key) if self.l2 is not None else None
        return None if info is None else info.meta

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

        None when ``key`` is already held (in L1 being written or stored, or
        in L2: see below) or nothing evictable frees enough contiguous space.
        ``parent`` is the previous chunk of the same prompt, for prefix-aware
        eviction.

        Keys name content: a tier that holds a key answers a store of it as
        already stored, so that no two tiers hold different bytes under one
        key. L2's index is in memory, so a store never waits on the disk.
        The shared tier is not asked here (a network round trip on every
        PREPARE_STORE, and the keys this sidecar saw there may have expired
        since): its upload finds an object already there, and this sidecar's
        copies yield to it then (:mod:`.writeback`).
        """
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        if self._in_l2(key):
            with self._index.tally() as counts:
                counts.store_deduplicated_total += 1
            return None
        if meta.store_tiers != store_tiers:  # dataclasses.replace costs µs per store
            meta = replace(meta, store_tiers=store_tiers)
        return self._index.reserve(key, nbytes, meta, owner, parent)

    def supersede(self, slot: Slot, covers: Sequence[ChunkKey]) -> None:
        """The chunk being written into ``slot`` supersedes the partial chunks
        ``covers``: once it is in the shared tier they are deleted there too
        (whoever wrote them; see :mod:`.partials`). An ended lease is ignored."""
        self._index.supersede(slot.lease_id, covers)

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
        return self._index.commit(lease_id, ok, client)

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
        slot = self._promotion.acquire(key, owner, tiers=tiers)
        if slot is None or blocks is None or blocks_match(slot.meta, blocks):
            return slot
        self.release(slot)
        with self._index.tally() as counts:
            counts.partial_mismatch_total += 1
        return None

    def client_ended(self, client: str) -> bool:
        """Whether ``release_client(client)`` was called: its session is gone."""
        return self._index.client_ended(client)

    def release(self, slot: Slot) -> None:
        """End a read lease."""
        self.release_lease(slot.lease_id)

    def release_lease(self, lease_id: int, client: str | None = None) -> bool:
        """End a lease by id (a write lease is aborted); False if unknown or
        (with ``client``) another client's."""
        return self._index.release_lease(lease_id, client)

    def release_owner(self, owner: str) -> int:
        """End every lease of ``owner``; the number ended. Prefetches of
        ``owner`` still running end their leases as soon as they land."""
        return self._index.release_owner(owner)

    def release_client(self, client: str) -> int:
        """End every lease of ``client`` (see :mod:`.leases`); the number ended.
        Its prefetches still running end their leases as soon as they land,
        and the client gets no lease from now on: it has ended."""
        return self._index.release_client(client)

    def client_write_bytes(self, client: str) -> int:
        """Arena bytes ``client`` holds for writing: its uncommitted write
        leases and its quarantined slots (expired leases whose writer has not
        said it is done), so an expired lease still counts against its client."""
        return self._index.client_write_bytes(client)

    def lease_counts(self) -> dict[str, int]:
        """Leases held per client."""
        return self._index.lease_counts()

    def expire_leases(self, now: float | None = None) -> int:
        """End leases older than ``server.lease_seconds`` (``now``: monotonic)."""
        now = time.monotonic() if now is None else now
        return self._index.expire_leases(now - self.config.server.lease_seconds)

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
        scheduled, to_fetch = self._index.plan_prefetch(keys, owner, self._may_be_below)
        self._prefetcher.start(to_fetch, owner, tiers)
        return scheduled

    def _may_be_below(self, key: ChunkKey) -> bool:
        """Whether a tier below L1 may hold ``key`` (L2's index says; the shared
        tier is not asked: it may hold anything)."""
        return self.shared is not None or self._in_l2(key)

    # -- maintenance --------------------------------------------------------

    def remove(self, key: ChunkKey) -> None:
        """Forget ``key`` in every tier (L1 frees it once no lease pins it)."""
        self._index.remove(key)
        self._wb.forget(key)
        if self.l2 is not None:
            self.l2.remove(key)
        if self.shared is not None:
            self.shared.remove(key)

    def clear(self, shared: bool = False) -> None:
        """Forget every chunk in L1 and L2 (and the shared tier's namespace
        only when ``shared`` is set: other sidecars use it too)."""
        self._index.clear()
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
        """Every tier's figures and the engine's counters and gauges at one moment."""
        stats = self._index.snapshot()
        pinned, backlog = self._wb.figures()
        stats.gauges = replace(
            stats.gauges, writeback_pinned_bytes=pinned, writeback_backlog=backlog
        )
        for label, tier in (("l2", self.l2), ("shared", self.shared)):
            figures = None if tier is None else tier.tenant_figures()
            if figures is not None:
                stats.tenants = with_tier(stats.tenants, label, figures)
        for tier in (self.l2, self.shared):
            if tier is not None:
                stats.tiers[tier.name] = self._wb.tier_stats(tier.stats())
        return stats

    def close(self) -> None:
        """Stop threads and unlink the shared-memory segment."""
        if not self._index.close():
            return
        self._prefetcher.close()
        self._wb.close()
        if self.l2 is not None:
            self.l2.close()
        self.arena.close()

    def __enter__(self) -> StorageManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
