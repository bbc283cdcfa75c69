"""Who is still there: clients whose session ended, and prefetches on their way.

Why a module of its own: both tables answer one question for the L1 index
(:mod:`.l1index`) -- may this owner still hold a lease? -- and their rules
(an ended client is remembered for a bounded number of endings; a prefetch
landing for a released owner ends its lease at once) are easier to check
apart from the leases themselves. Not thread-safe: the index calls both
under its lock.

An owner is ``"<client>/<request>"`` (see :mod:`.leases`).

State (process memory only)::

    EndedClients.ended:      client -> None, oldest first (at most MAX_ENDED_CLIENTS)
    PrefetchOwners.in_flight: owner -> keys a prefetch of that owner is fetching
    PrefetchOwners.released:  owners released while their prefetches ran
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from kvstrata.sidecar.keys import ChunkKey
from kvstrata.sidecar.leases import client_of

__all__ = ["MAX_ENDED_CLIENTS", "EndedClients", "PrefetchOwners"]

# Ended clients remembered (session ids are random and never reused; a
# request for one ended longer ago than this many endings is long gone).
MAX_ENDED_CLIENTS = 16384


class EndedClients:
    """The clients whose session ended, most recent last (bounded)."""

    def __init__(self, limit: int = MAX_ENDED_CLIENTS) -> None:
        self._ended: OrderedDict[str, None] = OrderedDict()
        self._limit = limit

    def add(self, client: str) -> None:
        self._ended[client] = None
        if len(self._ended) > self._limit:
            self._ended.popitem(last=False)

    def __contains__(self, client: object) -> bool:
        return client in self._ended

    def has_owner(self, owner: str) -> bool:
        """Whether ``owner``'s client ended."""
        return client_of(owner) in self._ended


class PrefetchOwners:
    """The keys each owner's prefetches are bringing into L1 (module docstring)."""

    def __init__(self) -> None:
        self._in_flight: dict[str, set[ChunkKey]] = {}
        self._released: set[str] = set()

    def expect(self, owner: str, keys: Iterable[ChunkKey]) -> None:
        """Jobs of ``owner`` for ``keys`` are about to start (noted before they
        exist, so that a release of ``owner`` from now on ends their leases)."""
        self._in_flight.setdefault(owner, set()).update(keys)

    def in_flight(self, owner: str) -> set[ChunkKey]:
        """The keys ``owner``'s running jobs are fetching (a copy)."""
        return set(self._in_flight.get(owner, ()))

    def queued(self) -> int:
        """Chunks on their way into L1 for some owner."""
        return sum(len(keys) for keys in self._in_flight.values())

    def release_owner(self, owner: str) -> None:
        """Leases ``owner``'s running jobs take are to end as they land."""
        if owner in self._in_flight:
            self._released.add(owner)

    def release_client(self, client: str) -> None:
        """:meth:`release_owner` for every owner of ``client``."""
        self._released.update(o for o in self._in_flight if client_of(o) == client)

    def landed(self, owner: str, key: ChunkKey) -> bool:
        """The job of ``owner`` for ``key`` ended; whether its lease must end
        (its owner was released meanwhile)."""
        released = owner in self._released
        left = self._in_flight.get(owner, set())
        left.discard(key)
        if not left:
            self._in_flight.pop(owner, None)
            self._released.discard(owner)
        return released
