"""How the connector's client reaches its sidecar: the session, deadlines, retries, back-off.

Why a module of its own: :class:`SidecarSession` carries every request of
:class:`~kvstrata.connector.client.SidecarClient` (which says what to ask)
and decides how it reaches the sidecar. Every call has a deadline
(``call_timeout_s``) and answers None on any sidecar problem (down, slow,
restarting, error reply, garbage), counting why in
:attr:`SidecarSession.errors`; it never raises and never hangs.

Connection life cycle (all inside calls, nothing in the background):

* lazily on the first call: HELLO, then ``mmap`` of ``/dev/shm/<arena>``
  (:mod:`kvstrata.connector.client_arena`);
* a reply ``no_session`` (the sidecar restarted or reaped us), or a sidecar
  that cannot be reached, drops the session and unmaps its arena; the
  session says HELLO again, maps the arena it names and bumps :attr:`epoch`; ops whose
  arguments do not refer to leases (``_RETRYABLE``: LOOKUP, PREPARE_STORE,
  PREPARE_RETRIEVE, PING, STATS, EVENTS) are then retried once within the
  same deadline;
* one retry policy for every call (:mod:`kvstrata.connector.backoff`):
  after a call the sidecar did not answer (unreachable, timed out, HELLO
  refused) every call inside the back-off window answers None at once,
  without touching the network (counted as ``backoff``); the first call
  after it probes the sidecar, and any answered call ends the back-off.

Replies carry the request id; replies to requests that timed out are
discarded when they arrive late. A call waiting for its reply also watches
the session's liveness connection (``ipc://PATH`` endpoints,
:mod:`kvstrata.connector.liveness_watch`): when the sidecar process ends,
SIGKILL included, the call ends at once as a miss (counted as
``sidecar_gone``), instead of at its deadline; the calls after it back off
like after any unanswered call. Thread-safe: one lock around the socket.
Slots handed out under an older :attr:`epoch` are void (the arena they
point into may be another segment now).

No vLLM or kopf imports here.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from kvstrata.connector.backoff import BACKOFF_MAX_S, BACKOFF_MIN_S, Backoff
from kvstrata.connector.client_arena import MappedArena, Populate
from kvstrata.connector.client_ipc import REGISTER_TIMEOUT_S, IpcOps, sidecar_deadline_ms
from kvstrata.connector.liveness_watch import LivenessWatch, closed_by_peer
from kvstrata.connector.transport import Channel, CurveKeys
from kvstrata.sidecar import protocol as p
from kvstrata.sidecar.keys import Namespace
from kvstrata.sidecar.transfer_mode import TransferMode

__all__ = ["SidecarSession"]

# The client's logger: the session's lines are the client's.
logger = logging.getLogger("kvstrata.connector.client")

# Ops retried once after a re-HELLO (their arguments hold no lease ids).
_RETRYABLE = frozenset({p.LOOKUP, p.PREPARE_STORE, p.PREPARE_RETRIEVE, p.PING, p.STATS, p.EVENTS})


class _NotOurs:
    """A received frame that does not answer the call waiting (see ``_take_reply``)."""


_NOT_OURS = _NotOurs()


class SidecarSession:
    """One session with the sidecar (module docstring); the operations are
    :class:`~kvstrata.connector.client.SidecarClient`'s."""

    def __init__(
        self,
        endpoint: str,
        namespace: Namespace,
        *,
        role: str,
        call_timeout_s: float = 0.5,
        client_id: str | None = None,
        transfer_mode: TransferMode = TransferMode.HOST,
        curve: CurveKeys | None = None,
        backoff_s: float = BACKOFF_MIN_S,
        backoff_max_s: float = BACKOFF_MAX_S,
        more_namespaces: Sequence[Namespace] = (),
        kv_events: bool = False,
        backoff_clock: Callable[[], float] = time.monotonic,
        populate_arena: Populate | str = Populate.BACKGROUND,
    ) -> None:
        # One retry policy for every call (kvstrata.connector.backoff).
        self._backoff = Backoff(backoff_s, backoff_max_s, backoff_clock)
        self.endpoint = endpoint
        self.curve = curve
        self.namespace = namespace
        self.role = role
        # The settings below are chosen here, once, and read-only after: a call
        # that needs another deadline or another filling of its first mapping
        # says so as an argument (connect), so no call changes another's.
        self._call_timeout_s = float(call_timeout_s)
        self.client_id = client_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.fingerprint: bytes = namespace.fingerprint()
        # Further namespaces this session may name (a scheduler's other ranks).
        self.more_fingerprints: list[bytes] = [ns.fingerprint() for ns in more_namespaces]
        self.kv_events = kv_events  # HELLO asks the sidecar to record tier events
        # How the arena mapping's page table is filled (kvstrata.sidecar.prefault):
        # "now" at the first HELLO, "background" on a thread, "off" for a
        # client that never copies (a scheduler: its thread would take a core
        # from the process's real work for nothing).
        self._populate_arena = Populate.parse(populate_arena)
        self._init_hello_answers()
        self.errors: dict[str, int] = {}
        self._lock = threading.RLock()
        self._channel = Channel(endpoint, curve)
        self._session_id = ""
        self._arena: MappedArena | None = None
        self._epoch = 0
        self._next_id = 0
        self._connected = False
        self._closed = False
        # What HELLO asks for (ipc once KV is registered: register_kv, its one
        # writer) and what the sidecar granted at the last HELLO; members,
        # never strings.
        self._requested_mode = transfer_mode
        self._granted_mode = TransferMode.HOST
        # ipc mode's operations and the KV registration they rest on.
        self.ipc = IpcOps(self._call, self._count, self._bad_reply)
        self._live = LivenessWatch(endpoint)  # the session's liveness connection

    def _init_hello_answers(self) -> None:
        """What the sidecar says at HELLO about the session: nothing yet."""
        self.chunk_size: int | None = None
        self.write_budget = 0  # uncommitted write bytes the sidecar lets this session hold
        # How long the sidecar keeps a lease's slot pinned (HELLO); until then, none.
        self.lease_seconds = 0.0
        # The tenants this session may name, with the cache_salts that name them
        # (HELLO's answer; kvstrata.connector.tenant_match picks one per request).
        self.tenants: list[p.TenantMatchInfo] = []
        self.server_version: str | None = None

    # -- properties -----------------------------------------------------------

    @property
    def call_timeout_s(self) -> float:
        """The deadline of each call (seconds), unless the call names its own."""
        return self._call_timeout_s

    @property
    def populate_arena(self) -> Populate:
        """How a first mapping's page table is filled, unless :meth:`connect` names another."""
        return self._populate_arena

    @property
    def requested_mode(self) -> TransferMode:
        """What HELLO asks for: IPC from :meth:`register_kv` on, HOST before."""
        return self._requested_mode

    @property
    def arena(self) -> memoryview | None:
        """The shared L1 segment, mapped read-write; None while not connected."""
        arena = self._arena
        return arena.view if arena is not None and self._connected else None

    @property
    def epoch(self) -> int:
        """Bumps on every (re)connect and re-map; slots of an older epoch are void."""
        return self._epoch

    @property
    def transfer_mode(self) -> TransferMode:
        """IPC while the sidecar serves this client's registered KV by block
        ids, else HOST (copies through the arena). Changes only at a HELLO."""
        return self._granted_mode

    @property
    def ipc_granted(self) -> bool:
        """Whether the sidecar copies for this client (ipc mode) as of the last HELLO."""
        return self._granted_mode is TransferMode.IPC

    def available(self) -> bool:
        """Connected now, as of the last call (no I/O)."""
        return self._connected and not self._closed

    # -- ipc mode -------------------------------------------------------------------

    @property
    def ipc_fallback_reason(self) -> str:
        """Why ipc mode is not used, once it was refused ("" until then)."""
        return self.ipc.fallback_reason

    def register_kv(self, body: p.RegisterKVRequest) -> None:
        """Share the KV tensors for ipc mode: sent now and after every re-HELLO,
        whose HELLO asks for ipc mode from now on.

        When the sidecar refuses (no GPU it can see, bad handles), the client
        stays in host mode, says why once and counts ``ipc_fallback``.
        """
        with self._lock:
            self._requested_mode = TransferMode.IPC
            self.ipc.registration = body
            if self._connected and self.ipc_granted:
                timeout = max(self._call_timeout_s, REGISTER_TIMEOUT_S)
                self._send_registration(time.monotonic() + timeout)

    def ipc_unavailable(self, why: str) -> None:
        """The worker cannot offer ipc mode (e.g. its KV has no CUDA IPC handle):
        host mode, said once with ``why`` and counted as ``ipc_fallback``."""
        with self._lock:
            self.ipc.unavailable(why)

    def _send_registration(self, deadline: float) -> None:
        """Caller holds the lock: REGISTER_KV; host mode unless it is accepted."""
        body = self.ipc.registration
        assert body is not None  # callers check
        reply = self._roundtrip(p.REGISTER_KV, body, deadline)
        if reply is None and self.ipc.awaiting:
            # Not refused: a restarted sidecar page-locks its arena for our GPU at
            # this first registration (seconds), longer than a step's call may
            # wait. Host mode until its answer comes in (IpcOps.late_answer).
            self._granted_mode = TransferMode.HOST
            return
        if not self.ipc.accepted(reply):
            self._granted_mode = TransferMode.HOST

    def connect(self, *, timeout_s: float | None = None, populate: Populate | None = None) -> bool:
        """Set a session up now if there is none (HELLO, arena mapping, a KV
        registration's resend) and check it with a PING; whether it answered.

        Both arguments apply to this call only: ``timeout_s`` is its deadline
        (default :attr:`call_timeout_s`; a worker registering its KV waits
        longer, see ``REGISTER_TIMEOUT_S``), ``populate`` fills the mapping a
        first HELLO of this call makes (default :attr:`populate_arena`)."""
        reply = self._call(p.PING, p.PingRequest(), timeout_s=timeout_s, populate=populate)
        return isinstance(reply, p.PingReply)

    def close(self) -> None:
        """Close the socket and unmap the arena; later calls return None/False."""
        with self._lock:
            self._closed = True
            self._connected = False
            self._channel.close()
            self._live.close()
            if self._arena is not None:
                self._arena.close()
                self._arena = None

    # -- plumbing -------------------------------------------------------------------

    def _count(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1

    def _bad_reply(self, op: str, why: str) -> None:
        logger.warning("sidecar reply to %s refused: %s", op, why)
        self._count("bad_reply")
        return None

    def _call(
        self,
        op: str,
        body: p.Message,
        *,
        timeout_s: float | None = None,
        populate: Populate | None = None,
    ) -> p.Message | None:
        """One request with the deadline (``timeout_s``, else
        :attr:`call_timeout_s`); the reply body or None (counted). ``populate``:
        see :meth:`connect`."""
        try:
            with self._lock:
                if self._closed:
                    self._count("closed")
                    return None
                if self._backoff.waiting():  # backing off: no I/O
                    self._count("backoff")
                    return None
                timeout = self._call_timeout_s if timeout_s is None else timeout_s
                deadline = time.monotonic() + timeout
                if self._live.sidecar_gone():
                    # The sidecar ended since the last call: HELLO whichever
                    # listens now rather than wait on a session that is gone.
                    self._lost_session()
                if not self._session_id and not self._hello(deadline, populate):
                    return None
                reply = self._roundtrip(op, body, deadline)
                if isinstance(reply, p.ErrorReply) and reply.code == p.E_NO_SESSION:
                    self._lost_session()
                    if not (self._hello(deadline, populate) and op in _RETRYABLE):
                        # Leases named by this call died with the old session.
                        self._count(p.E_NO_SESSION)
                        return None
                    reply = self._roundtrip(op, body, deadline)
                if reply is not None:
                    self._answered()
                if isinstance(reply, p.ErrorReply):
                    logger.debug("sidecar refused %s: %s", op, reply.message)
                    self._count(reply.code)
                    return None
                return reply
        except Exception:  # the cache is optional: a bug here must cost a miss only
            logger.exception("sidecar call %s failed", op)
            self._count("internal")
            return None

    def _hello(self, deadline: float, populate: Populate | None = None) -> bool:
        hello = p.HelloRequest(
            client_id=self.client_id,
            role=self.role,
            fingerprint=self.fingerprint,
            namespace=_namespace_map(self.namespace),
            transfer_mode=self._requested_mode,
            pid=os.getpid(),
            fingerprints=self.more_fingerprints,
            kv_events=self.kv_events,
        )
        self.ipc.awaiting = 0  # a registration of an earlier session answers nothing now
        reply = self._roundtrip(p.HELLO, hello, deadline)
        if not isinstance(reply, p.HelloReply):
            if isinstance(reply, p.ErrorReply):  # no answer has backed off already
                self._count(reply.code)
                self._back_off()
            return False
        try:
            # The first mapping as asked; after a sidecar restart a "now" would
            # sit inside whichever step re-connects: in the background instead.
            populate = self._populate_arena if populate is None else populate
            if populate is Populate.NOW and self._epoch > 0:
                populate = Populate.BACKGROUND
            arena = MappedArena(reply.arena_name, reply.arena_size, populate)
        except (OSError, ValueError) as exc:
            logger.warning("cannot map the sidecar arena %s: %s", reply.arena_name, exc)
            self._count("arena_map")
            self._back_off()
            return False
        if self._arena is not None:
            self._arena.close()
        self._arena = arena
        self._session_id = reply.session_id
        self.chunk_size = reply.chunk_size
        # An older sidecar does not say: its default share, a quarter of L1.
        self.write_budget = reply.write_budget or reply.arena_size // 4
        self.lease_seconds = reply.lease_seconds
        self.tenants = reply.tenants
        self.server_version = reply.server_version
        self._epoch += 1
        self._connected = True
        self._answered()
        self._live.open(reply.session_id)
        self._granted_mode = reply.transfer_mode
        if self._requested_mode is TransferMode.IPC and not self.ipc_granted:
            self.ipc.fall_back(reply.fallback_reason or "not served")
        elif self.ipc_granted and self.ipc.registration is not None:
            # Half of what is left: a registration the sidecar is slow to take
            # (see _send_registration) must leave the call that re-connected
            # time for its own request.
            now = time.monotonic()
            self._send_registration(now + max(0.0, deadline - now) / 2)
        logger.info(
            "connected to sidecar %s (epoch %d, %s mode)",
            self.endpoint,
            self._epoch,
            self._granted_mode.value,
        )
        return True

    def _back_off(self) -> None:
        """The sidecar did not answer: calls answer at once for a while, and
        for twice as long (up to the cap) after each further miss."""
        self._connected = False
        self._backoff.missed()

    def _answered(self) -> None:
        self._backoff.answered()

    def _lost_session(self) -> None:
        """The session is gone (sidecar down, restarted or reaping us): so is the
        arena it named. Unmap it now rather than at the next HELLO, so a
        restarted sidecar finds the old segment's memory free in ``/dev/shm``
        (a copy still running on a view of it keeps it mapped until it ends)."""
        self._session_id = ""
        self._connected = False
        self.ipc.awaiting = 0  # a registration of that session answers nothing now
        self._live.close()  # it belonged to the session; the next HELLO opens another
        if self._arena is not None:
            self._arena.close()
            self._arena = None

    def _send(self, frame: bytes, deadline: float) -> bool:
        if self._channel.not_listening():
            # Nothing listens yet: waiting out the deadline would stall a vLLM
            # step for nothing.
            self._count("unavailable")
            return False
        return self._channel.send(frame, deadline)

    def _roundtrip(self, op: str, body: p.Message, deadline: float) -> p.Message | None:
        """Send one request and wait for its reply until ``deadline``.

        Returns the reply body (an :class:`ErrorReply` for error replies) or
        None after counting a timeout, an unreachable sidecar or a bad reply.
        """
        sock = self._channel.socket()
        self._next_id += 1
        request_id = self._next_id
        if isinstance(body, (p.SaveBlocksRequest, p.LoadBlocksRequest)):
            body.deadline_ms = sidecar_deadline_ms(deadline - time.monotonic())
        frame = p.encode_request(op, request_id, self._session_id, body)
        if not self._send(frame, deadline):
            self._count("unavailable")
            self._lost_session()
            self._back_off()
            return None
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        live = self._live.socket
        if live is not None:
            # The sidecar never writes here: readable means its end closed.
            poller.register(live.fileno(), zmq.POLLIN)
        while True:
            remaining_ms = (deadline - time.monotonic()) * 1000
            events = dict(poller.poll(remaining_ms)) if remaining_ms > 0 else {}
            if live is not None and live.fileno() in events and closed_by_peer(live):
                # The sidecar process is gone (killed or stopping): no reply
                # will come, so this call is a miss now, not at its deadline.
                self._count("sidecar_gone")
                self._lost_session()
                self._back_off()
                return None
            if sock not in events:
                if remaining_ms > 0 and live is not None and live.fileno() in events:
                    continue  # bytes on the liveness socket: not an end
                self._count("timeout")
                if op == p.REGISTER_KV and self._session_id:
                    self.ipc.awaiting = request_id  # slow, not gone: see _send_registration
                else:
                    self._back_off()
                return None
            taken = self._take_reply(sock.recv_multipart(zmq.NOBLOCK), op, request_id)
            if not isinstance(taken, _NotOurs):
                return taken

    def _take_reply(
        self, frames: list[bytes], op: str, request_id: int
    ) -> p.Message | _NotOurs | None:
        """What one received frame means to the call waiting for ``request_id``:
        its reply body, None for a bad reply (counted), or :data:`_NOT_OURS`
        for a frame it skips (a slow registration's answer, a late reply)."""
        if self.ipc.awaiting and p.peek_request_id(frames[0]) == self.ipc.awaiting:
            if self.ipc.late_answer(frames):  # the registration went through
                self._granted_mode = TransferMode.IPC
            return _NOT_OURS
        try:
            reply = p.decode_reply(frames, op)
        except p.ProtocolError as exc:
            if exc.request_id not in (0, request_id) or not frames:
                return _NOT_OURS  # a late reply to an abandoned request
            if p.peek_request_id(frames[0]) != request_id:
                return _NOT_OURS
            logger.warning("bad reply to %s: %s", op, exc)
            self._count("bad_reply")
            return None
        if reply.request_id != request_id:
            self._count("late_reply")
            return _NOT_OURS
        if reply.ok:
            self._connected = True
        return reply.body


def _namespace_map(namespace: Namespace) -> dict[str, Any]:
    return {f: getattr(namespace, f) for f in namespace.__dataclass_fields__}
