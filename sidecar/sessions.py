"""Client sessions and the leases each one holds.

Why: the engine knows leases by id and owner string; the server must also
know *which client* holds them, so that a client that vanishes (no message
for ``server.client_timeout_seconds``) has its leases reclaimed, and so that
one client cannot commit or release another client's leases.

A session belongs to the ZeroMQ peer that said HELLO (its ROUTER identity,
one per connection): a request naming it from any other peer is answered
as if the session did not exist, and a HELLO replaces only sessions of the
same peer. Session ids are 128 random bits and are never published; a
client whose connection was re-made (new identity) says HELLO again.

State (in memory only, lost on restart; a restarted sidecar answers
``no_session`` and clients say HELLO again)::

    sessions:  session_id -> Session(client_id, role, pid, fingerprint, identity,
                                     last_seen, owners, write_bytes)
    leases:    lease_id   -> Lease(session_id, owner_key, kind, slot, created)

Owner strings from the wire (vLLM request ids) are made unique per session
as ``"<session_id>/<owner>"`` before they reach the engine, so two vLLM
processes using the same request id never share leases.

Thread-safe: the server loop and its worker pool both use it.
"""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from kvstrata.sidecar.engine import Slot

LeaseKind = Literal["read", "write"]


@dataclass(slots=True)
class Session:
    session_id: str
    client_id: str
    role: str
    pid: int
    transfer_mode: str
    identity: bytes  # the ZeroMQ peer that opened it; no other peer may use it
    fingerprint: bytes  # the namespace every key of this session must carry
    created: float
    last_seen: float
    owners: set[str] = field(default_factory=set)
    requests: int = 0
    write_bytes: int = 0  # arena bytes under this session's uncommitted write leases
    # namespaces its keys may carry besides ``fingerprint`` (a scheduler's other ranks)
    more_fingerprints: frozenset[bytes] = frozenset()

    def owner_key(self, owner: str) -> str:
        return f"{self.session_id}/{owner}"


@dataclass(slots=True)
class Lease:
    session_id: str
    owner_key: str
    kind: LeaseKind
    slot: Slot
    created: float


class SessionTable:
    """Sessions and their leases (see the module docstring)."""

    def __init__(self, client_timeout_seconds: float, lease_seconds: float) -> None:
        self.client_timeout_seconds = client_timeout_seconds
        self.lease_seconds = lease_seconds
        self._lock = threading.Lock()
        self._sessions: dict[str, Session] = {}
        self._leases: dict[int, Lease] = {}
        self.reaped_total = 0

    # -- sessions ---------------------------------------------------------

    def open(
        self,
        client_id: str,
        role: str,
        pid: int,
        transfer_mode: str,
        identity: bytes,
        fingerprint: bytes,
        more_fingerprints: frozenset[bytes] = frozenset(),
    ) -> tuple[Session, list[Session]]:
        """A new session of peer ``identity``; also returns the sessions it
        replaces: those of the same peer, client id, role and pid (the caller
        reclaims their leases: a client says HELLO again only when it has
        given its old session up). Another peer copying the client id, role
        and pid replaces nothing."""
        now = time.monotonic()
        session = Session(
            session_id=secrets.token_hex(16),
            client_id=client_id,
            role=role,
            pid=pid,
            transfer_mode=transfer_mode,
            identity=identity,
            fingerprint=fingerprint,
            more_fingerprints=more_fingerprints,
            created=now,
            last_seen=now,
        )
        me = (client_id, role, pid, identity)
        with self._lock:
            replaced = [
                s
                for s in self._sessions.values()
                if client_id and (s.client_id, s.role, s.pid, s.identity) == me
            ]
            for old in replaced:
                del self._sessions[old.session_id]
            self._sessions[session.session_id] = session
        return session, replaced

    def touch(self, session_id: str, identity: bytes) -> Session | None:
        """The live session with this id opened by peer ``identity`` (marked
        seen), or None: unknown, or another peer's."""
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None or not secrets.compare_digest(session.identity, identity):
                return None
            session.last_seen = time.monotonic()
            session.requests += 1
            return session

    def idle(self, now: float | None = None) -> list[Session]:
        """Remove and return the sessions silent for longer than the client timeout."""
        now = time.monotonic() if now is None else now
        with self._lock:
            gone = [
                s
                for s in self._sessions.values()
                if now - s.last_seen > self.client_timeout_seconds
            ]
            for session in gone:
                del self._sessions[session.session_id]
            self.reaped_total += len(gone)
        return gone

    def remove(self, session_id: str) -> Session | None:
        """Remove and return a session whose process is gone (None if unknown)."""
        with self._lock:
            session = self._sessions.pop(session_id, None)
            if session is not None:
                self.reaped_total += 1
            return session

    def sessions(self) -> list[Session]:
        with self._lock:
            return list(self._sessions.values())

    def __len__(self) -> int:
        return len(self._sessions)

    # -- leases -----------------------------------------------------------

    def add_lease(self, session: Session, owner_key: str, kind: LeaseKind, slot: Slot) -> None:
        with self._lock:
            session.owners.add(owner_key)
            self._leases[slot.lease_id] = Lease(
                session.session_id, owner_key, kind, slot, time.monotonic()
            )
            if kind == "write":
                session.write_bytes += slot.length

    def _forget(self, lease_id: int) -> Lease:
        """Caller holds the lock: drop one lease record, keeping write_bytes in step."""
        lease = self._leases.pop(lease_id)
        if lease.kind == "write":
            session = self._sessions.get(lease.session_id)
            if session is not None:
                session.write_bytes -= lease.slot.length
        return lease

    def note_owner(self, session: Session, owner_key: str) -> None:
        """Remember an owner the engine may hold leases for (prefetch)."""
        with self._lock:
            session.owners.add(owner_key)

    def take_lease(self, session: Session, lease_id: int, kind: LeaseKind) -> Lease | None:
        """Remove and return ``lease_id`` if this session holds it as ``kind``."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None or lease.session_id != session.session_id or lease.kind != kind:
                return None
            return self._forget(lease_id)

    def drop_owner(self, owner_key: str) -> int:
        """Forget the leases of one owner (after the engine released them)."""
        with self._lock:
            ids = [i for i, lease in self._leases.items() if lease.owner_key == owner_key]
            for lease_id in ids:
                self._forget(lease_id)
            for session in self._sessions.values():
                session.owners.discard(owner_key)
            return len(ids)

    def drop_session_leases(self, session: Session) -> list[Lease]:
        with self._lock:
            ids = [i for i, lease in self._leases.items() if lease.session_id == session.session_id]
            return [self._forget(i) for i in ids]

    def expire(self, now: float | None = None) -> int:
        """Forget lease records older than the lease time (the engine expires
        the leases themselves)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            ids = [
                i for i, lease in self._leases.items() if now - lease.created > self.lease_seconds
            ]
            for lease_id in ids:
                self._forget(lease_id)
            return len(ids)

    def lease_counts(self) -> dict[str, int]:
        """Leases held per session id (for /status)."""
        with self._lock:
            counts: dict[str, int] = {}
            for lease in self._leases.values():
                counts[lease.session_id] = counts.get(lease.session_id, 0) + 1
            return counts
