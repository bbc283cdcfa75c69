"""GETs a lookup opened, held for the promotion that fetches them next.

Why: asking S3 whether a prompt's chunks exist and then fetching them costs
two requests per chunk (a HEAD, then a GET) and two round trips before the
first byte of KV arrives. A lookup whose caller fetches what it finds (a
LOOKUP with ``prefetch``, which the connector always sends) sends GETs
instead: the status line answers the lookup, and the response, its body not
read yet, waits here until the promotion's GET of the same object takes it
instead of sending a request of its own. Measured against moto on the
benchmark VM: 16 HEADs took 40-50 ms, and a fresh sidecar's lookup with
its fetches cost moto 2-3 times the CPU of the same GETs alone
(``docs/benchmarks.md``, "warm start from S3 with one request per chunk").

Bounds: at most ``capacity`` responses are held (a lookup asks with HEADs
for what would not fit); each is held at most ``ttl`` seconds, then closed
by the next call that looks; :meth:`HeldGets.close_all` closes every one
(the tier's ``close``). Closing a response whose body was not read drops its
connection, which is what a response nobody will read should cost. Both
outcomes are counted (``kvstrata_tier_lookup_gets_used_total`` and
``kvstrata_tier_lookup_gets_closed_total``): many closed against few used
means lookups open GETs that nobody reads.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

__all__ = ["HeldGets", "close_response"]


def close_response(response: dict[str, Any]) -> None:
    """Close a GET's response without reading its body (drops the connection)."""
    body = response.get("Body")
    if body is not None:
        with contextlib.suppress(Exception):
            body.close()


class HeldGets:
    """Opened GET responses by object name, oldest first (module docstring)."""

    def __init__(
        self, capacity: int, ttl: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.capacity = capacity
        self.ttl = ttl
        self._clock = clock
        self._lock = threading.Lock()
        self._held: OrderedDict[str, tuple[dict[str, Any], float]] = OrderedDict()
        self.taken_total = 0  # responses a fetch used instead of a request
        self.closed_unread_total = 0  # responses closed unread (expired, surplus, not wanted)

    def room(self) -> int:
        """How many more responses may be held now."""
        with self._lock:
            doomed = self._expired_locked()
            room = max(0, self.capacity - len(self._held))
        self._close(doomed)
        return room

    def holds(self, name: str) -> bool:
        with self._lock:
            doomed = self._expired_locked()
            held = name in self._held
        self._close(doomed)
        return held

    def hold(self, name: str, response: dict[str, Any]) -> None:
        """Keep ``response`` for the next :meth:`take` of ``name`` (replacing
        and closing one held before; the oldest goes beyond ``capacity``)."""
        with self._lock:
            doomed = self._expired_locked()
            old = self._held.pop(name, None)
            if old is not None:
                doomed.append(old[0])
            self._held[name] = (response, self._clock() + self.ttl)
            while len(self._held) > self.capacity:
                doomed.append(self._held.popitem(last=False)[1][0])
        self._close(doomed)

    def take(self, name: str) -> dict[str, Any] | None:
        """The held response of ``name`` (no longer held), or None."""
        with self._lock:
            doomed = self._expired_locked()
            got = self._held.pop(name, None)
            if got is not None:
                self.taken_total += 1
        self._close(doomed)
        return None if got is None else got[0]

    def drop(self, name: str) -> None:
        """Close the held response of ``name``, if any: nobody will read it."""
        with self._lock:
            got = self._held.pop(name, None)
        if got is not None:
            self._close([got[0]])

    def discard(self, response: dict[str, Any]) -> None:
        """Close a response that was never held: nobody will read it."""
        self._close([response])

    def close_all(self) -> None:
        with self._lock:
            doomed = [response for response, _ in self._held.values()]
            self._held.clear()
        self._close(doomed)

    def _expired_locked(self) -> list[dict[str, Any]]:
        """Caller holds the lock: take the expired responses out (the caller
        closes them once the lock is released)."""
        now = self._clock()
        expired: list[dict[str, Any]] = []
        while self._held:
            name, (response, deadline) = next(iter(self._held.items()))
            if deadline > now:
                break
            del self._held[name]
            expired.append(response)
        return expired

    def _close(self, responses: list[dict[str, Any]]) -> None:
        if not responses:
            return
        with self._lock:
            self.closed_unread_total += len(responses)
        for response in responses:
            close_response(response)
