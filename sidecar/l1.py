"""The L1 store: which chunk lives where in the arena, and who pins it.

Why separate from the L1 index (:mod:`.l1index`): this is the bookkeeping
only (allocator, eviction policy, pin counts), with no threads, no I/O and
no locking; its one owner, the index, calls every method under its lock and
never holds that lock while copying bytes.

State (process memory only; the arena itself has no header)::

    entries: ChunkKey -> Entry(offset, length, meta, state, pins, ...)
    namespace_bytes: fingerprint -> bytes of its entries in the index

With a ``namespace_quota`` each namespace (a key's first 16 bytes: one
model, one tenant) holds at most that many bytes; a store beyond it evicts
that namespace's own chunks first (in policy order), never another's, and
is refused when they are all pinned.

A partial chunk (a prompt's tail after its last full chunk, ``meta.blocks``
> 0) takes free space or evicts other partial chunks only, never a full
chunk: every prompt leaves one, few are ever read again (only when a later
prompt extends that exact one, as a conversation's next turn does), and
under a small L1 they would push out full chunks that later prompts hit.
Full chunks evict in policy order, partials included, so a partial that a
conversation keeps using stays while it is warm.

Tenants (:mod:`.tenants`): a tenant with ``budgets.l1_bytes`` holds at
most that many bytes; a store beyond it evicts that tenant's own chunks
first, or is refused when the tenant is pinned (its chunks are then never
evicted by anyone else's store or promotion either). A budget of 0 keeps
nothing. A tenant with a TTL has its chunks dropped by :meth:`L1Store.expire`
once they are older than it. Refusals and evictions are counted per tenant
in the :class:`~.tenants.TenantLedger`.

An entry is WRITING from ``reserve`` until ``publish`` (only its writer
sees it), then READY. ``pins`` counts leases and internal holds
(write-behind, prefetch); a pinned entry is never evicted and its extent
never freed. An entry removed while pinned is marked ``dead``: it leaves
the index at once and its extent is freed when the last pin goes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvstrata.sidecar.allocator import ExtentAllocator
from kvstrata.sidecar.keys import FINGERPRINT_BYTES, ChunkKey
from kvstrata.sidecar.objformat import ChunkMeta
from kvstrata.sidecar.policies import EvictionPolicy, make_policy
from kvstrata.sidecar.tenants import TenantLedger, TenantRules

if TYPE_CHECKING:
    from kvstrata.sidecar.journal import TierEvents

WRITING = 0
READY = 1


@dataclass(slots=True, eq=False)
class Entry:
    key: ChunkKey
    offset: int
    length: int
    meta: ChunkMeta
    parent: ChunkKey | None = None
    state: int = WRITING
    pins: int = 0
    dead: bool = False
    promoting: bool = False  # filled from a lower tier by the engine itself
    shared_pending: bool = False  # "reused" admission: upload on the first hit
    # Partial chunks this chunk supersedes: deleted from the shared tier once
    # this chunk is written there (kvstrata.sidecar.partials).
    supersedes: tuple[ChunkKey, ...] = ()
    # The shared tier already held other bytes under this key: this copy was
    # dropped, and so is its L2 copy when that write ends (kvstrata.sidecar.writeback).
    yielded: bool = False
    # When it became READY (the store's clock): its age at eviction tells thrash apart
    # from the turnover of a cold cache.
    published_at: float = 0.0


class L1Store:
    """Allocator + policy + index of one arena (not thread-safe)."""

    def __init__(
        self,
        size: int,
        policy: str = "lru",
        prefix_aware: bool = False,
        alignment: int = 256,
        namespace_quota: int | None = None,
        tenants: TenantRules | None = None,
        young_seconds: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.namespace_quota = namespace_quota
        self.tenants = TenantLedger(tenants or TenantRules())
        # An eviction of an entry READY for less than this counts as young (thrash).
        self.young_seconds = young_seconds
        self._clock = clock
        self.namespace_bytes: dict[bytes, int] = {}
        self.allocator = ExtentAllocator(size, alignment)
        self.policy: EvictionPolicy = make_policy(policy, self.allocator.size, prefix_aware)
        self.entries: dict[ChunkKey, Entry] = {}
        self.evictions_total = 0
        self.evicted_bytes_total = 0
        self.young_evictions_total = 0
        self.ready_bytes = 0
        # Told when a chunk becomes READY and when a READY chunk leaves (KV events).
        self.events: TierEvents | None = None

    @property
    def capacity(self) -> int:
        return self.allocator.size

    def reserve(
        self,
        key: ChunkKey,
        nbytes: int,
        meta: ChunkMeta,
        parent: ChunkKey | None = None,
        read_now: bool = False,
    ) -> Entry | None:
        """A WRITING entry with one pin, evicting unpinned READY entries as
        needed; None when the key exists or nothing more can be evicted.
        ``read_now``: a promotion a reader waits for, which a partial chunk
        may make room for like any chunk (its lookup already answered a hit)."""
        if key in self.entries or nbytes > self.allocator.size:
            return None
        namespace = key[:FINGERPRINT_BYTES]
        partial = meta.blocks > 0 and not read_now  # see the module docstring
        tenant = meta.tenant
        if not self._within_tenant_budget(tenant, nbytes, partial):
            return None
        if self.namespace_quota is not None and not self._within_quota(
            namespace, nbytes, partial, tenant
        ):
            return None
        offset = self.allocator.alloc(nbytes)
        if offset is None:
            offset = self._evict_until_fits(nbytes, partial, tenant)
            if offset is None:
                return None
        entry = Entry(key, offset, nbytes, meta, parent, pins=1)
        self.entries[key] = entry
        self.namespace_bytes[namespace] = self.namespace_bytes.get(namespace, 0) + nbytes
        self.tenants.l1_bytes[tenant] += nbytes
        return entry

    def _within_tenant_budget(self, tenant: str, nbytes: int, partials_only: bool) -> bool:
        """Make room for ``nbytes`` more of ``tenant`` within its L1 budget
        (evicting its own chunks unless it is pinned); False, counted, when
        the store is refused."""
        rules = self.tenants.rules
        budget = rules.l1_budget(tenant)
        if budget is None:
            return True
        if budget == 0 or nbytes > budget:
            self.tenants.refuse(tenant, "l1", "not_kept" if budget == 0 else "budget")
            return False
        if self.tenants.l1_bytes[tenant] + nbytes <= budget:
            return True
        if rules.pinned(tenant):
            # Within its budget nothing of a pinned tenant is evicted, its own
            # stores included: what it keeps is what it stored first.
            self.tenants.refuse(tenant, "l1", "pinned_budget")
            return False
        for victim in self.policy.victims():
            entry = self.entries.get(victim)
            if entry is None or entry.meta.tenant != tenant:
                continue
            if not self._evictable(entry, partials_only, tenant):
                continue
            self._evict(entry)
            if self.tenants.l1_bytes[tenant] + nbytes <= budget:
                return True
        self.tenants.refuse(tenant, "l1", "budget")
        return False

    def expire(self) -> list[ChunkKey]:
        """Drop every chunk older than its tenant's TTL (a later read misses);
        the keys whose L2 copies the caller must remove (L2 tells the ledger
        when it wrote them). A chunk's copies go together: an L1 copy promoted
        from L2 is as old as the L2 one. Cheap when no tenant has a TTL."""
        if not self.tenants.rules.ttl_tenants:
            return []
        now = self._clock()
        old_l1 = self.tenants.expired("l1", now)
        old_l2 = self.tenants.expired("l2", now)
        for tenant, _ in old_l2:
            self.tenants.aged_out(tenant, "l2")
        for tenant, key in old_l1 + old_l2:
            entry = self.entries.get(key)
            if entry is not None and entry.meta.tenant == tenant:
                self._drop(entry)  # a reader's pin keeps its bytes until it is done
                self.tenants.aged_out(tenant, "l1")
        for tenant, key in old_l1:
            if self.tenants.forget("l2", tenant, key):
                self.tenants.aged_out(tenant, "l2")
        return [key for _, key in old_l1 + old_l2]

    def now(self) -> float:
        """The clock TTLs are measured with (monotonic; a test's own)."""
        return self._clock()

    def _within_quota(
        self, namespace: bytes, nbytes: int, partials_only: bool, tenant: str
    ) -> bool:
        """Evict this namespace's own unpinned chunks (only partial ones with
        ``partials_only``) until ``nbytes`` more fit its quota."""
        quota = self.namespace_quota
        assert quota is not None  # the caller checks
        if nbytes > quota:
            return False
        if self.namespace_bytes.get(namespace, 0) + nbytes <= quota:
            return True
        for victim in self.policy.victims():
            if victim[:FINGERPRINT_BYTES] != namespace:
                continue
            entry = self.entries.get(victim)
            if not self._evictable(entry, partials_only, tenant):
                continue
            assert entry is not None  # _evictable says so
            self._evict(entry)
            if self.namespace_bytes.get(namespace, 0) + nbytes <= quota:
                return True
        return False

    def _evictable(self, entry: Entry | None, partials_only: bool, for_tenant: str) -> bool:
        """Whether a store of ``for_tenant`` may evict ``entry``: never a pinned
        entry, and never a pinned tenant's chunk for another tenant's store."""
        if entry is None or entry.pins or entry.state != READY:
            return False
        owner = entry.meta.tenant
        if owner and owner != for_tenant and self.tenants.rules.pinned(owner):
            return False
        return not partials_only or entry.meta.blocks > 0

    def _evict_until_fits(self, nbytes: int, partials_only: bool, tenant: str) -> int | None:
        entries = self.entries
        for victim in self.policy.victims():
            entry = entries.get(victim)
            if not self._evictable(entry, partials_only, tenant):
                continue
            assert entry is not None  # _evictable says so
            self._evict(entry)
            offset = self.allocator.alloc(nbytes)
            if offset is not None:
                return offset
        return None

    def _evict(self, entry: Entry) -> None:
        """Drop an evictable entry for room, counting it (young: see ``young_seconds``)."""
        self._drop(entry)
        self.evictions_total += 1
        self.evicted_bytes_total += entry.length
        if self._clock() - entry.published_at < self.young_seconds:
            self.young_evictions_total += 1
        self.tenants.evicted(entry.meta.tenant, "l1")

    def publish(self, entry: Entry) -> None:
        """WRITING -> READY: visible to lookups, known to the policy."""
        entry.state = READY
        entry.published_at = self._clock()
        self.ready_bytes += entry.length
        self.tenants.stored("l1", entry.meta.tenant, entry.key, self._clock())
        self.policy.on_insert(entry.key, entry.length, entry.parent)
        if self.events is not None:
            self.events.stored(entry.key)

    def unpin(self, entry: Entry) -> None:
        entry.pins -= 1
        if entry.pins <= 0 and entry.dead:
            self.allocator.free(entry.offset)
            entry.offset = -1

    def abort(self, entry: Entry, keep_pinned: bool = False) -> None:
        """Take an unpublished ``entry`` out of the index (or mark it dead when
        it left already); its extent is freed at its last unpin. ``keep_pinned``:
        its writer's pin stays (a quarantined slot: :mod:`.l1index`)."""
        if self.entries.get(entry.key) is entry:
            self.remove(entry.key)
        else:
            entry.dead = True
        entry.promoting = False
        if not keep_pinned:
            self.unpin(entry)

    def remove(self, key: ChunkKey) -> Entry | None:
        """Drop ``key`` from the index; its extent is freed now or at its last unpin."""
        entry = self.entries.get(key)
        if entry is not None:
            self._drop(entry)
        return entry

    def _drop(self, entry: Entry) -> None:
        del self.entries[entry.key]
        namespace = entry.key[:FINGERPRINT_BYTES]
        left = self.namespace_bytes[namespace] - entry.length
        if left:
            self.namespace_bytes[namespace] = left
        else:
            del self.namespace_bytes[namespace]
        tenant = entry.meta.tenant
        self.tenants.l1_bytes[tenant] -= entry.length
        self.tenants.forget("l1", tenant, entry.key)
        if entry.state == READY:
            self.ready_bytes -= entry.length
            self.policy.on_remove(entry.key)
            if self.events is not None:
                self.events.removed(entry.key)
        entry.dead = True
        if entry.pins <= 0:
            self.allocator.free(entry.offset)
            entry.offset = -1
