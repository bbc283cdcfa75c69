"""Client sessions: who is connected, from which peer, in which namespace.

Why: the server must know *which client* sent a request, so that a client
that vanishes (no message for ``server.client_timeout_seconds``) has its
leases reclaimed, and so that one client cannot commit or release another
client's leases. The leases themselves are the engine's (one table, see
:mod:`.leases`); a session is the client they are held for.

A session belongs to the ZeroMQ peer that said HELLO (its ROUTER identity,
one per connection): a request naming it from any other peer is answered
as if the session did not exist, and a HELLO replaces only sessions of the
same peer. Session ids are 128 random bits and are never published; a
client whose connection was re-made (new identity) says HELLO again.

Bounds (a client that says HELLO in a loop must not grow this table, nor
``/status``, without end): one peer holds at most
``server.max_sessions_per_peer`` sessions and the processes of one uid, where
the ``ipc://`` socket reports it, at most ``server.max_sessions_per_uid``. A
HELLO past either is refused (:class:`SessionLimit`); the client's existing
sessions stay as they are.

State (in memory only, lost on restart; a restarted sidecar answers
``no_session`` and clients say HELLO again)::

    sessions:  session_id -> Session(client_id, role, pid, fingerprint, identity,
                                     last_seen, requests)

Owner strings from the wire (vLLM request ids) are made unique per session
as ``"<session_id>/<owner>"`` before they reach the engine, so two vLLM
processes using the same request id never share leases, and the engine
knows each lease's client (the session id).

Thread-safe: the server loop and its worker pool both use it.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import TypeVar

from kvstrata.sidecar.leases import OWNER_SEP
from kvstrata.sidecar.transfer_mode import TransferMode

_K = TypeVar("_K")


@dataclass(slots=True)
class Session:
    session_id: str
    client_id: str
    role: str
    pid: int
    transfer_mode: TransferMode
    identity: bytes  # the ZeroMQ peer that opened it; no other peer may use it
    fingerprint: bytes  # the namespace every key of this session must carry
    created: float
    last_seen: float
    requests: int = 0
    # namespaces its keys may carry besides ``fingerprint`` (a scheduler's other ranks)
    more_fingerprints: frozenset[bytes] = frozenset()
    uid: int | None = None  # the kernel's word, on ipc:// endpoints; None elsewhere
    model: str = ""  # the model of HELLO's namespace (tenants' match.models)

    def owner_key(self, owner: str) -> str:
        return f"{self.session_id}{OWNER_SEP}{owner}"


def _decrement(counts: Counter[_K], key: _K) -> None:
    """One fewer for ``key``; a key at zero leaves the counter (peers come and go)."""
    counts[key] -= 1
    if counts[key] <= 0:
        del counts[key]


class SessionLimit(Exception):
    """A HELLO past a per-client bound; ``bound`` names it (``sessions_per_peer``
    or ``sessions_per_uid``), the message says which setting to change."""

    def __init__(self, bound: str, message: str) -> None:
        super().__init__(message)
        self.bound = bound


class SessionTable:
    """Sessions (see the module docstring)."""

    def __init__(
        self,
        client_timeout_seconds: float,
        max_per_peer: int = 16,
        max_per_uid: int = 256,
    ) -> None:
        self.client_timeout_seconds = client_timeout_seconds
        self.max_per_peer = max_per_peer
        self.max_per_uid = max_per_uid
        self._lock = threading.Lock()
        self._sessions: dict[str, Session] = {}
        # Open sessions per peer and per uid, kept with the table (a HELLO must
        # not scan every session to be judged).
        self._per_peer: Counter[bytes] = Counter()
        self._per_uid: Counter[int] = Counter()
        self.reaped_total = 0

    # -- sessions ---------------------------------------------------------

    def open(
        self,
        client_id: str,
        role: str,
        pid: int,
        transfer_mode: TransferMode,
        identity: bytes,
        fingerprint: bytes,
        more_fingerprints: frozenset[bytes] = frozenset(),
        uid: int | None = None,
        model: str = "",
    ) -> tuple[Session, list[Session]]:
        """A new session of peer ``identity``; also returns the sessions it
        replaces: those of the same peer, client id, role and pid (the caller
        reclaims their leases: a client says HELLO again only when it has
        given its old session up). Another peer copying the client id, role
        and pid replaces nothing. Raises :class:`SessionLimit` when the peer
        or ``uid`` already holds its most sessions (those it replaces aside)."""
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
            uid=uid,
            model=model,
        )
        me = (client_id, role, pid, identity)
        with self._lock:
            replaced = [
                s
                for s in self._sessions.values()
                if client_id and (s.client_id, s.role, s.pid, s.identity) == me
            ]
            self._check_bounds(identity, uid, replaced)
            for old in replaced:
                self._forget(old)
            self._sessions[session.session_id] = session
            self._per_peer[identity] += 1
            if uid is not None:
                self._per_uid[uid] += 1
        return session, replaced

    def _check_bounds(self, identity: bytes, uid: int | None, replaced: list[Session]) -> None:
        """Raise :class:`SessionLimit` if one more session of this peer (or uid)
        would pass its bound; the sessions a HELLO replaces do not count."""
        peer_after = self._per_peer[identity] - len(replaced) + 1
        if peer_after > self.max_per_peer:
            raise SessionLimit(
                "sessions_per_peer",
                f"this connection already holds {self.max_per_peer} sessions "
                "(server.max_sessions_per_peer); reuse one, or end one first",
            )
        if uid is None:
            return
        uid_after = self._per_uid[uid] - sum(s.uid == uid for s in replaced) + 1
        if uid_after > self.max_per_uid:
            raise SessionLimit(
                "sessions_per_uid",
                f"processes of uid {uid} already hold {self.max_per_uid} sessions "
                "(server.max_sessions_per_uid); idle ones end after "
                "server.client_timeout_seconds",
            )

    def _forget(self, session: Session) -> None:
        """Drop ``session`` from the table and its counts (the lock is held)."""
        del self._sessions[session.session_id]
        _decrement(self._per_peer, session.identity)
        if session.uid is not None:
            _decrement(self._per_uid, session.uid)

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
                self._forget(session)
            self.reaped_total += len(gone)
        return gone

    def remove(self, session_id: str) -> Session | None:
        """Remove and return a session whose process is gone (None if unknown)."""
        with self._lock:
            session = self._sessions.get(session_id)
            if session is not None:
                self._forget(session)
                self.reaped_total += 1
            return session

    def exists(self, session_id: str) -> bool:
        """Whether a session with this id is open (whoever opened it)."""
        with self._lock:
            return session_id in self._sessions

    def sessions(self) -> list[Session]:
        with self._lock:
            return list(self._sessions.values())

    def __len__(self) -> int:
        return len(self._sessions)
