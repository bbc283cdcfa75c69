"""Leases: who holds which arena slot, and since when.

Why a module of its own: the engine's contract with clients is expressed in
leases (the wire carries lease ids), and the rules -- ids never reused, a
lease per owner, expiry by age -- are easier to check apart from the
tiering logic. Not thread-safe: the engine calls it under its index lock.

State (process memory only)::

    leases:   lease_id -> Lease(slot, entry, owner, write, created)
    by_owner: owner -> {lease_id, ...}
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

from kvstrata.sidecar.keys import ChunkKey
from kvstrata.sidecar.l1 import Entry
from kvstrata.sidecar.objformat import ChunkMeta


@dataclass(frozen=True, slots=True)
class Slot:
    """A leased region of the L1 arena holding (or about to hold) one chunk."""

    lease_id: int  # unique per lease, never reused within one engine
    key: ChunkKey
    offset: int  # byte offset in the arena segment
    length: int  # bytes
    meta: ChunkMeta


# A frozen dataclass's __init__ goes through object.__setattr__ per field
# (~3 us for a Slot on the dev box, as much as copying a 256 KiB chunk).
# Setting the slot descriptors directly builds the same immutable object in
# a third of the time; Slot stays frozen for everyone else.
_set_lease_id, _set_key, _set_offset, _set_length, _set_meta = (
    Slot.__dict__[name].__set__ for name in ("lease_id", "key", "offset", "length", "meta")
)


def make_slot(lease_id: int, key: ChunkKey, offset: int, length: int, meta: ChunkMeta) -> Slot:
    """``Slot(...)``, fast (see above)."""
    slot = object.__new__(Slot)
    _set_lease_id(slot, lease_id)
    _set_key(slot, key)
    _set_offset(slot, offset)
    _set_length(slot, length)
    _set_meta(slot, meta)
    return slot


@dataclass(slots=True, eq=False)
class Lease:
    slot: Slot
    entry: Entry
    owner: str
    write: bool
    created: float  # time.monotonic()


class LeaseTable:
    """Leases by id and by owner (see the module docstring)."""

    def __init__(self) -> None:
        self._leases: dict[int, Lease] = {}
        self._by_owner: dict[str, set[int]] = {}
        self._ids = itertools.count(1)

    def __len__(self) -> int:
        return len(self._leases)

    def new(self, entry: Entry, owner: str, write: bool) -> Slot:
        """A lease on ``entry``; the caller has already pinned it."""
        slot = make_slot(next(self._ids), entry.key, entry.offset, entry.length, entry.meta)
        self._leases[slot.lease_id] = Lease(slot, entry, owner, write, time.monotonic())
        self._by_owner.setdefault(owner, set()).add(slot.lease_id)
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
        return lease

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
