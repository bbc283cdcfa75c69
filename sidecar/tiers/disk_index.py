"""The disk tier's index: which files it holds, in LRU order, and what they use.

Why a module of its own: :class:`DiskIndex` owns the bookkeeping the disk
tier (:mod:`.disk`) keeps in memory about its files: one
:class:`DiskEntry` per key, least recently used first; the bytes indexed
and the bytes reserved for writes in flight; each namespace's bytes
against ``namespace_quota``; each tenant's through its
:class:`~.tenant_shares.TenantShares`; and which files to evict, and how
many evictions were of young files (thrash). It touches no file and takes
no lock: the tier calls it under its own lock, and unlinks and reports
(KV events) the keys it is handed back.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import ItemsView, Iterator
from dataclasses import dataclass

from kvstrata.sidecar.keys import FINGERPRINT_BYTES
from kvstrata.sidecar.objformat import ChunkMeta
from kvstrata.sidecar.tiers.tenant_shares import TenantShares

__all__ = ["DiskEntry", "DiskIndex"]


@dataclass(frozen=True, slots=True)
class DiskEntry:
    file_bytes: int
    header_bytes: int
    payload_bytes: int
    meta: ChunkMeta
    codec: str = "none"
    # Sealed: the payload is ciphertext then tag, read whole and opened.
    # payload_bytes is always the decoded length (what L1 reserves for it),
    # whatever the file holds: sealed, compressed or plain.
    sealed: bool = False
    # time.monotonic() when this process wrote it; files found at start count as old.
    stored_at: float = float("-inf")
    # time.time() when it was written (a file found at start: its mtime), for
    # its tenant's TTL across a restart.
    written_unix: float = 0.0


class DiskIndex:
    """The disk tier's files in memory (module docstring). Not thread-safe:
    every call is made under the tier's lock."""

    def __init__(
        self,
        capacity_bytes: int,
        namespace_quota: int | None,
        tenants: TenantShares,
        young_seconds: float,
    ) -> None:
        self.capacity_bytes = capacity_bytes
        # Most file bytes one namespace (a key's first 16 bytes) may hold; a
        # write beyond it evicts that namespace's own least recent files first.
        # Writes in flight are not counted against it (a brief overshoot).
        self.namespace_quota = namespace_quota
        self.tenants = tenants
        # An eviction of a file written less than this long ago counts as young (thrash).
        self.young_seconds = young_seconds
        self._entries: OrderedDict[bytes, DiskEntry] = OrderedDict()  # LRU first
        self._ns_usage: dict[bytes, int] = {}
        self.usage = 0  # file bytes indexed
        self.reserved = 0  # file bytes of writes in flight
        self.evictions_total = 0
        self.young_evictions_total = 0

    # -- reading ----------------------------------------------------------------------

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._entries)

    def items(self) -> ItemsView[bytes, DiskEntry]:
        return self._entries.items()

    def get(self, key: bytes) -> DiskEntry | None:
        return self._entries.get(key)

    def touch(self, key: bytes) -> DiskEntry | None:
        """``key``'s entry, now the most recently used; None when absent."""
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    # -- changes ----------------------------------------------------------------------

    def add(self, key: bytes, entry: DiskEntry) -> DiskEntry | None:
        """Index ``entry`` as the most recent, in place of any older one under
        its key; the older one, or None."""
        old = self.pop(key)
        self._entries[key] = entry
        self._account(key, entry, entry.file_bytes)
        return old

    def pop(self, key: bytes) -> DiskEntry | None:
        """Forget ``key`` (not an eviction); its entry, or None when absent."""
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._account(key, entry, -entry.file_bytes)
        return entry

    def clear(self) -> list[bytes]:
        """Forget every file; their keys."""
        keys = list(self._entries)
        self._entries.clear()
        self.usage = 0
        self._ns_usage.clear()
        self.tenants.clear()
        return keys

    def admit(self, key: bytes, tenant: str, nbytes: int) -> tuple[bool, list[bytes]]:
        """Reserve room for a new file of ``nbytes`` of ``tenant`` under
        ``key``, evicting the tenant's, then the namespace's, then anyone's
        least recent files as needed: (reserved, the keys evicted). Not
        reserved: too large, over the tenant's budget (refused, counted
        there), or the rest is pinned tenants' files. :meth:`release` ends
        a reservation."""
        quota = self.namespace_quota
        if nbytes > self.capacity_bytes or (quota is not None and nbytes > quota):
            return False, []
        refused = self.tenants.refusal(tenant, nbytes)
        if refused is not None:
            self.tenants.refuse(tenant, refused)
            return False, []
        evicted = self._evict_tenant(tenant, nbytes)
        evicted += self._evict_namespace(key, tenant, nbytes) + self.evict(nbytes)
        if self.usage + self.reserved + nbytes > self.capacity_bytes:
            return False, evicted
        if not self._within_namespace_quota(key, nbytes):  # the rest is pinned tenants'
            return False, evicted
        self.reserved += nbytes
        self.tenants.reserve(tenant, nbytes)
        return True, evicted

    def release(self, tenant: str, nbytes: int) -> None:
        """The write :meth:`admit` reserved for is over (indexed or failed)."""
        self.reserved -= nbytes
        self.tenants.reserve(tenant, -nbytes)

    def evict(self, incoming: int) -> list[bytes]:
        """Evict least recent files until ``incoming`` more fits, passing over
        pinned tenants' files (it may then not fit: :meth:`admit` checks)."""
        excess = self.usage + self.reserved + incoming - self.capacity_bytes
        victims: list[bytes] = []
        for key, entry in self._entries.items():  # least recent first; stops once enough
            if excess <= 0:
                break
            if not self.tenants.protected(entry.meta.tenant):
                victims.append(key)
                excess -= entry.file_bytes
        return [self._evict(key) for key in victims]

    # -- internals ----------------------------------------------------------------------

    def _evict(self, key: bytes) -> bytes:
        entry = self._entries.pop(key)
        self._account(key, entry, -entry.file_bytes)
        self.evictions_total += 1
        if time.monotonic() - entry.stored_at < self.young_seconds:
            self.young_evictions_total += 1
        return key

    def _evict_tenant(self, tenant: str, incoming: int) -> list[bytes]:
        """Evict ``tenant``'s own least recent files until ``incoming`` more is
        within its budget (a pinned tenant was refused before this)."""
        if not self.tenants.over(tenant, incoming):
            return []
        excess = self.tenants.excess(tenant, incoming)
        victims: list[bytes] = []
        for key, entry in self._entries.items():  # least recent first; stops once enough
            if excess <= 0:
                break
            if entry.meta.tenant == tenant:
                victims.append(key)
                excess -= entry.file_bytes
        self.tenants.evictions[tenant] += len(victims)
        return [self._evict(key) for key in victims]

    def _within_namespace_quota(self, key: bytes, incoming: int) -> bool:
        """Whether ``incoming`` more fits ``key``'s namespace's quota."""
        quota = self.namespace_quota
        return quota is None or self._ns_usage.get(key[:FINGERPRINT_BYTES], 0) + incoming <= quota

    def _evict_namespace(self, key: bytes, tenant: str, incoming: int) -> list[bytes]:
        """Evict ``key``'s namespace's least recent files until ``incoming`` more (of
        ``tenant``'s) fits its quota, passing over other pinned tenants' files:
        tenants named by their Kubernetes namespace share a model's namespace here,
        and a pinned tenant's files are never evicted for another's store (as in L1;
        the store may then not fit: :meth:`admit` checks)."""
        if self._within_namespace_quota(key, incoming):
            return []
        namespace = key[:FINGERPRINT_BYTES]
        evicted: list[bytes] = []
        for victim, entry in list(self._entries.items()):
            if self._within_namespace_quota(key, incoming):
                break
            if victim[:FINGERPRINT_BYTES] != namespace:
                continue
            owner = entry.meta.tenant
            if owner == tenant or not self.tenants.protected(owner):
                evicted.append(self._evict(victim))
        return evicted

    def _account(self, key: bytes, entry: DiskEntry, delta: int) -> None:
        """Total, per-namespace and per-tenant usage."""
        self.usage += delta
        self.tenants.add(entry.meta.tenant, delta)
        if self.namespace_quota is None:
            return
        namespace = key[:FINGERPRINT_BYTES]
        left = self._ns_usage.get(namespace, 0) + delta
        if left > 0:
            self._ns_usage[namespace] = left
        else:
            self._ns_usage.pop(namespace, None)
