"""Leases: who holds which arena slot, and since when.

Why a module of its own: the engine's contract with clients is expressed in
leases (the wire carries lease ids), and the rules -- ids never reused, a
lease per owner, expiry by age -- are easier to check apart from the
tiering logic. This is the one lease table of a sidecar: the server asks
the engine, which asks the L1 index (:mod:`.l1index`, which keeps it),
which client holds a lease and how many write bytes a client holds. Not
thread-safe: the index calls it under its lock.

An owner is ``"<client>/<request>"`` (the server makes request ids unique
per session that way, the session id being the client); an owner with no
``/`` is a client of its own (the engine's internal owners).

An expired write lease is *quarantined* rather than ended (see
:mod:`.l1index`): its slot stays pinned until its writer says it is done, and
its bytes still count against its client (:meth:`LeaseTable.held_bytes`),
so a client whose leases expire cannot take more of the arena than a client
that holds them.

State (process memory only)::

    leases:            lease_id -> Lease(slot, entry, owner, client, write, created)
    by_owner:          owner -> {lease_id, ...}
    write_bytes:       client -> arena bytes under its uncommitted write leases
    quarantined:       lease_id -> Lease, expired write leases whose writer may still write
    quarantined_bytes: client -> arena bytes of its quarantined slots
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import NamedTuple

from kvstrata.sidecar.keys import ChunkKey
from kvstrata.sidecar.l1 import Entry
from kvstrata.sidecar.objformat import ChunkMeta


class Slot(NamedTuple):
    """A leased region of the L1 arena holding (or about to hold) one chunk.

    A named tuple: immutable, and built on every lease (several per request)
    at a third of a frozen dataclass's cost."""

    lease_id: int  # unique per lease, never reused within one engine
    key: ChunkKey
    offset: int  # byte offset in the arena segment
    length: int  # bytes
    meta: ChunkMeta


OWNER_SEP = "/"


def client_of(owner: str) -> str:
    """The client part of an owner ``"<client>/<request>"`` (see the module docstring)."""
    return owner.partition(OWNER_SEP)[0]


@dataclass(slots=True, eq=False)
class Lease:
    slot: Slot
    entry: Entry
    owner: str
    client: str
    write: bool
    created: float  # time.monotonic()


class LeaseTable:
    """Leases by id and by owner (see the module docstring)."""

    def __init__(self) -> None:
        self._leases: dict[int, Lease] = {}
        self._by_owner: dict[str, set[int]] = {}
        self._write_bytes: dict[str, int] = {}
        self._quarantined: dict[int, Lease] = {}
        self._quarantined_bytes: dict[str, int] = {}
        self._ids = itertools.count(1)

    def __len__(self) -> int:
        return len(self._leases)

    def new(self, entry: Entry, owner: str, write: bool) -> Slot:
        """A lease on ``entry``; the caller has already pinned it."""
        # A hot path (every chunk of every request): Slot._make skips the
        # named tuple's Python-level __new__, and the owner's set is built
        # only when it is the owner's first lease.
        lease_id = next(self._ids)
        slot = Slot._make((lease_id, entry.key, entry.offset, entry.length, entry.meta))
        client = owner.partition(OWNER_SEP)[0]  # client_of, inlined
        self._leases[lease_id] = Lease(slot, entry, owner, client, write, time.monotonic())
        ids = self._by_owner.get(owner)
        if ids is None:
            self._by_owner[owner] = {lease_id}
        else:
            ids.add(lease_id)
        if write:
            self._write_bytes[client] = self._write_bytes.get(client, 0) + slot.length
        return slot

    def get(self, lease_id: int) -> Lease | None:
        return self._leases.get(lease_id)

    def pop(self, lease_id: int) -> Lease | None:
        lease = self._leases.pop(lease_id, None)
        if lease is not None:
            ids = self._by_owner.get(lease.owner)
            if ids is not None:
                ids.discard(lease_id)
                if not ids:
                    del self._by_owner[lease.owner]
            if lease.write:
                left = self._write_bytes[lease.client] - lease.slot.length
                if left:
                    self._write_bytes[lease.client] = left
                else:
                    del self._write_bytes[lease.client]
        return lease

    def write_bytes(self, client: str) -> int:
        """Arena bytes under ``client``'s write leases."""
        return self._write_bytes.get(client, 0)

    def held_bytes(self, client: str) -> int:
        """Arena bytes ``client`` holds for writing: its write leases and its
        quarantined slots (what its write budget is measured against)."""
        return self._write_bytes.get(client, 0) + self._quarantined_bytes.get(client, 0)

    # -- quarantine ----------------------------------------------------------

    def quarantine(self, lease: Lease) -> None:
        """Keep ``lease`` (a popped, expired write lease) as quarantined."""
        self._quarantined[lease.slot.lease_id] = lease
        self._quarantined_bytes[lease.client] = (
            self._quarantined_bytes.get(lease.client, 0) + lease.slot.length
        )

    def unquarantine(self, lease_id: int, client: str | None = None) -> Lease | None:
        """Remove and return the quarantined lease ``lease_id`` (of ``client``
        when given); None if there is none."""
        lease = self._quarantined.get(lease_id)
        if lease is None or (client is not None and client != lease.client):
            return None
        del self._quarantined[lease_id]
        left = self._quarantined_bytes[lease.client] - lease.slot.length
        if left:
            self._quarantined_bytes[lease.client] = left
        else:
            del self._quarantined_bytes[lease.client]
        return lease

    def quarantined_ids(self, client: str) -> list[int]:
        """Ids of ``client``'s quarantined leases."""
        return [i for i, lease in self._quarantined.items() if lease.client == client]

    @property
    def quarantined_total(self) -> int:
        """Arena bytes of every quarantined slot."""
        return sum(self._quarantined_bytes.values())

    def counts(self) -> dict[str, int]:
        """Leases held per client."""
        counts: dict[str, int] = {}
        for lease in self._leases.values():
            counts[lease.client] = counts.get(lease.client, 0) + 1
        return counts

    def pop_client(self, client: str) -> list[Lease]:
        """Remove and return every lease of ``client``."""
        ids = [i for i, lease in self._leases.items() if lease.client == client]
        leases = [self.pop(i) for i in ids]
        return [lease for lease in leases if lease is not None]

    def read_keys(self, owner: str) -> set[ChunkKey]:
        """The keys ``owner`` holds read leases on."""
        leases = (self._leases[i] for i in self._by_owner.get(owner, ()))
        return {lease.slot.key for lease in leases if not lease.write}

    def pop_owner(self, owner: str) -> list[Lease]:
        """Remove and return every lease of ``owner``."""
        leases = [self.pop(i) for i in list(self._by_owner.get(owner, ()))]
        return [lease for lease in leases if lease is not None]

    def pop_older_than(self, cutoff: float) -> list[Lease]:
        """Remove and return every lease created at or before ``cutoff``."""
        old = [i for i, lease in self._leases.items() if lease.created <= cutoff]
        leases = [self.pop(i) for i in old]
        return [lease for lease in leases if lease is not None]
