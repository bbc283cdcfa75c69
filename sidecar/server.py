"""The sidecar's ZeroMQ server: one ROUTER socket, one loop, a small worker pool.

Why this shape: every vLLM process (scheduler and workers) talks to the
sidecar through one socket. The loop only parses, dispatches and replies;
anything that may wait on L2/L3 I/O (PREPARE_RETRIEVE promotions, lookups
that ask a remote tier) runs on a bounded worker pool whose results come
back through a wake-up pipe, so one slow request or one slow client never
stalls the others. Replies are sent without blocking: a client that stops
reading loses its replies, not everyone's throughput.

Housekeeping on the loop, every ``HOUSEKEEPING_SECONDS``: leases older than
``server.lease_seconds`` expire (``engine.expire_leases``) and clients
silent for ``server.client_timeout_seconds`` have their leases reclaimed.

No persistent state: sessions live in memory (see :mod:`.sessions`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import zmq

from kvstrata.sidecar import protocol as p
from kvstrata.sidecar.endpoint import ipc_path
from kvstrata.sidecar.engine_metrics import EngineCollector
from kvstrata.sidecar.fdbudget import FdBudget, ListenerCounts, plan
from kvstrata.sidecar.handlers import POOLED_OPS, POOLED_OPS_REMOTE, Handlers
from kvstrata.sidecar.liveness import (
    LivenessListener,
    liveness_path,
    restrict_socket_file,
    socket_umask,
)
from kvstrata.sidecar.logs import request_context
from kvstrata.sidecar.metrics import (
    IpcCollector,
    ListenerCollector,
    QueuedRepliesCollector,
    ServerMetrics,
)
from kvstrata.sidecar.peers import (
    ClientAdmission,
    PeerCredentials,
    credentials_from_peer_address,
)
from kvstrata.sidecar.replies import SNDHWM, QueuedReplies
from kvstrata.sidecar.sessions import Session, SessionTable
from kvstrata.sidecar.zmqgate import BACKLOG, ConnectionGate

if TYPE_CHECKING:
    from kvstrata.sidecar.config import SidecarConfig
    from kvstrata.sidecar.engine import StorageManager
    from kvstrata.sidecar.transfer.ipc import IpcTransfers

logger = logging.getLogger(__name__)

HOUSEKEEPING_SECONDS = 0.5
MAX_BATCH = 256  # messages read per loop turn before replies of the pool are sent
MAX_POOL_BACKLOG = 1024  # pooled requests waiting; beyond it requests get E_BUSY


def _no_gpu_stats() -> dict[str, object]:
    return {"copy_failures": {}, "expired": {}, "staging_fallbacks": 0, "fault": ""}


class SidecarServer:
    """Serves the protocol of :mod:`.protocol` for one engine.

    Life cycle: ``bind()`` (raises ``zmq.ZMQError`` if the endpoint is taken
    or invalid), ``serve(stop)`` until ``stop`` is set, ``close()``.
    """

    def __init__(
        self,
        config: SidecarConfig,
        engine: StorageManager,
        *,
        server_version: str,
        ipc: IpcTransfers | None = None,
        ipc_unavailable: str = "ipc mode is not enabled",
        workers: int = 4,
        remote_lookups: bool = False,
        fd_budget: FdBudget | None = None,
    ) -> None:
        self.config = config
        self.engine = engine
        self.metrics = ServerMetrics()
        self.sessions = SessionTable(
            config.server.client_timeout_seconds,
            max_per_peer=config.server.max_sessions_per_peer,
            max_per_uid=config.server.max_sessions_per_uid,
        )
        self.handlers = Handlers(
            engine, self.sessions, self.metrics, config, server_version, ipc, ipc_unavailable
        )
        self.metrics.attach(
            EngineCollector(engine.stats, lambda: len(self.sessions), self._count_error)
        )
        self.metrics.expect_tiers(engine.stats().tiers)
        self._ipc = ipc
        # Served without ipc too (zeros): one catalogue for every sidecar.
        self.metrics.attach(IpcCollector(ipc.gpu_stats if ipc is not None else _no_gpu_stats))
        # Connection caps of the HTTP port and the liveness socket, from the
        # descriptors still free now the engine is up (see .fdbudget).
        self.fd_budget = fd_budget if fd_budget is not None else plan()
        budget = self.fd_budget
        self.connection_counts = {
            name: ListenerCounts(getattr(budget, name), fd_ceiling=budget.fd_ceiling(name))
            for name in ("http", "liveness", "zmq")
        }
        self.metrics.attach(ListenerCollector(self.connection_counts))
        # Replies a client has not taken yet, bounded in bytes per client (.replies).
        self.replies = QueuedReplies(config.server.max_queued_reply_bytes)
        self.metrics.attach(QueuedRepliesCollector(self.replies.total))
        self.pooled_ops = POOLED_OPS_REMOTE if remote_lookups else POOLED_OPS
        self.endpoint = config.server.endpoint
        self.admission = ClientAdmission(config.server.client_uids)
        self.started = time.time()
        self._ctx: zmq.Context[Any] | None = None
        self._sock: zmq.Socket[Any] | None = None
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvstrata-req")
        self._backlog = 0
        self._backlog_lock = threading.Lock()
        self._done: queue.SimpleQueue[tuple[bytes, bytes]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._serving = threading.Event()
        self._bound_path: str | None = None
        self._liveness: LivenessListener | None = None
        self._auth: Any = None  # the ZAP handler thread when CURVE is configured
        self._gate: ConnectionGate | None = None  # the endpoint's door (ipc://PATH only)

    # -- life cycle ---------------------------------------------------------

    def bind(self) -> str:
        """Bind the ROUTER socket; returns the endpoint actually bound."""
        path = ipc_path(self.endpoint)
        if path is not None:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        group = self.config.server.socket_group
        self._ctx = zmq.Context()
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, p.MAX_MESSAGE_BYTES)
        sock.setsockopt(zmq.SNDHWM, SNDHWM)
        sock.setsockopt(zmq.RCVHWM, 10_000)
        sock.setsockopt(zmq.BACKLOG, BACKLOG)
        self._curve(sock)
        # An ipc://PATH endpoint's socket file is moved out of reach while no
        # more connections may be accepted (.zmqgate): libzmq aborts the
        # process when an accept finds no descriptor.
        gate = None
        if path is not None:
            gate = ConnectionGate(path, self.connection_counts)
        try:
            if gate is not None:
                gate.prepare()
            # Created 0660 (no moment of wider access): the socket file is the
            # door to the arena, for this pod's vLLM and no one else.
            with socket_umask():
                sock.bind(self.endpoint)
            if path is not None:
                restrict_socket_file(path, group)
            if gate is not None:
                gate.start(sock)
        except (zmq.ZMQError, OSError):
            if gate is not None:
                gate.close()
            sock.close(0)
            raise
        self._sock = sock
        self._gate = gate
        self._bound_path = path
        if path is not None:
            self._liveness = LivenessListener(
                liveness_path(path),
                self._client_gone,
                group,
                max_connections=self.fd_budget.liveness,
                known=self.sessions.exists,
                counts=self.connection_counts["liveness"],
            )
            self._liveness.start()
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        logger.info("serving on %s", self.endpoint)
        return self.endpoint

    def _curve(self, sock: zmq.Socket[Any]) -> None:
        """Make ``sock`` a CURVE server admitting only the listed client keys."""
        server = self.config.server
        if server.curve_secret_key_file is None or server.curve_client_keys_dir is None:
            return
        import zmq.auth
        from zmq.auth.thread import ThreadAuthenticator

        public, secret = zmq.auth.load_certificate(server.curve_secret_key_file)
        if not secret:
            raise OSError(f"server.curve_secret_key_file: {server.curve_secret_key_file} "
                          "holds no secret key")  # fmt: skip
        assert self._ctx is not None  # bind() made it
        self._auth = ThreadAuthenticator(self._ctx)
        self._auth.start()
        self._auth.configure_curve(domain="*", location=server.curve_client_keys_dir)
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        sock.curve_server = True
        logger.info("CURVE: clients listed in %s only", server.curve_client_keys_dir)

    @property
    def ready(self) -> bool:
        """Serving. A CUDA fault in ipc mode does not make the sidecar unready: its
        sessions move to host mode (``Handlers._retire_ipc_after_fault``); a native
        sidecar's readiness counts toward the Pod's, and a cache fault must never
        take vLLM out of its Service."""
        return self._serving.is_set()

    def wake(self) -> None:
        """Interrupt the loop's poll (from any thread or a signal handler)."""
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"x")

    def serve(self, stop: threading.Event) -> None:
        if self._sock is None:
            raise RuntimeError("bind() first")
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        next_housekeeping = time.monotonic() + HOUSEKEEPING_SECONDS
        self._serving.set()
        try:
            while not stop.is_set():
                timeout_ms = max(0.0, next_housekeeping - time.monotonic()) * 1000
                events = dict(poller.poll(timeout_ms))
                if self._sock in events:
                    self._read_batch()
                if self._wake_r in events:
                    with contextlib.suppress(BlockingIOError, OSError):
                        os.read(self._wake_r, 4096)
                self._send_done()
                if time.monotonic() >= next_housekeeping:
                    self._housekeeping()
                    next_housekeeping = time.monotonic() + HOUSEKEEPING_SECONDS
        finally:
            self._serving.clear()

    def close(self) -> None:
        self._serving.clear()
        if self._liveness is not None:
            self._liveness.close()
            self._liveness = None
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._gate is not None:
            self._gate.close()
            self._gate = None
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        if self._bound_path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._bound_path)
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    # -- the loop -----------------------------------------------------------

    def _read_batch(self) -> None:
        sock = self._sock
        for _ in range(MAX_BATCH):
            if sock is None:
                return
            try:
                # The routing-id frame uncopied: it carries the connection's
                # metadata (the peer's credentials, read for HELLO only).
                first = sock.recv(zmq.NOBLOCK, copy=False)
                frames = [first.bytes]
                while sock.getsockopt(zmq.RCVMORE):
                    frames.append(sock.recv(zmq.NOBLOCK))
            except zmq.Again:
                return
            except zmq.ZMQError as exc:
                logger.warning("recv failed: %s", exc)
                self._count_error("recv")
                return
            self._on_message(frames, first)

    def _on_message(self, frames: list[bytes], first: zmq.Frame | None = None) -> None:
        """Envelope, then session, then body: a frame of a peer without a
        session is refused before any per-item work on its body, so a few
        maximal frames cannot stall the loop for everyone else. Pooled ops
        read their body on the pool, off this loop."""
        started = time.perf_counter()
        identity, payload = frames[0], frames[1:]
        try:
            request = p.decode_envelope(payload)
        except p.ProtocolError as exc:
            self._refuse(identity, exc)
            return
        peer = self._credentials(first) if request.op == p.HELLO else None
        if request.op == p.HELLO and (why := self.admission.refusal(peer)) is not None:
            self._count_error(p.E_FORBIDDEN)
            self._send(identity, p.encode_error(request.request_id, p.E_FORBIDDEN, why))
            return
        session = None
        if request.session_id:
            session = self.sessions.touch(request.session_id, identity)
        # HELLO ignores a stale session id; PING answers without one, but a
        # PING naming a session we do not know tells the client to re-HELLO.
        stale = request.op == p.PING and bool(request.session_id)
        if session is None and (request.op not in p.SESSIONLESS_OPS or stale):
            self._count_error(p.E_NO_SESSION)
            message = f"{request.op}: unknown session {request.session_id!r}; say HELLO"
            self._send(identity, p.encode_error(request.request_id, p.E_NO_SESSION, message))
            return
        if request.op not in self.pooled_ops:
            try:
                full = p.decode_body(request)
            except p.ProtocolError as exc:
                self._refuse(identity, exc)
                return
            uid = peer.uid if peer is not None else None
            self._send(identity, self._answer(full, session, identity, started, uid))
            return
        with self._backlog_lock:
            busy = self._backlog >= MAX_POOL_BACKLOG
            if not busy:
                self._backlog += 1
        if busy:
            self._count_error(p.E_BUSY)
            message = f"{request.op}: {MAX_POOL_BACKLOG} requests already waiting"
            self._send(identity, p.encode_error(request.request_id, p.E_BUSY, message))
            return
        self._pool.submit(self._pooled, request, session, identity, started)

    def _refuse(self, identity: bytes, exc: p.ProtocolError) -> None:
        """Answer a frame that does not follow the protocol."""
        self._send(identity, self._refusal_reply(exc))

    def _refusal_reply(self, exc: p.ProtocolError) -> bytes:
        """The counted, logged answer to a frame that does not follow the
        protocol (with its request id when the envelope got that far, so the
        client can match the answer)."""
        self._count_error(exc.code)
        logger.debug("refused a frame: %s", exc)
        return p.encode_error(exc.request_id, exc.code, str(exc))

    def _credentials(self, first: zmq.Frame | None) -> PeerCredentials | None:
        """What the kernel says of the process that sent this frame (ipc:// only)."""
        address = None
        if first is not None and self.endpoint.startswith("ipc://"):
            try:
                address = first.get("Peer-Address")
            except zmq.ZMQError:  # a libzmq without the property: no credentials
                address = None
        return credentials_from_peer_address(address)

    def _pooled(
        self, envelope: p.Envelope, session: Session | None, identity: bytes, started: float
    ) -> None:
        try:
            try:
                request = p.decode_body(envelope)
            except p.ProtocolError as exc:
                reply = self._refusal_reply(exc)
            else:
                reply = self._answer(request, session, identity, started)
        finally:
            with self._backlog_lock:
                self._backlog -= 1
        self._done.put((identity, reply))
        self.wake()

    def _answer(
        self,
        request: p.Request,
        session: Session | None,
        identity: bytes,
        started: float,
        uid: int | None = None,
    ) -> bytes:
        """Run one request to its reply frame; never raises. What it logs carries
        the request's id, op and client (:mod:`kvstrata.sidecar.logs`)."""
        client = session.client_id if session is not None else "-"
        with request_context(request.request_id, request.op, client):
            try:
                body = self.handlers.handle(request, session, identity, started, uid)
                reply = p.encode_reply(request.request_id, body)
            except p.ProtocolError as exc:
                logger.debug("refused (%s): %s", exc.code, exc)
                self._count_error(exc.code)
                reply = p.encode_error(request.request_id, exc.code, f"{request.op}: {exc}")
            except Exception as exc:  # a bug must cost one request, never the server
                logger.exception("%s failed", request.op)
                self._count_error(p.E_INTERNAL)
                reply = p.encode_error(
                    request.request_id, p.E_INTERNAL, f"{request.op}: {type(exc).__name__}"
                )
        self.metrics.duration.labels(op=request.op).observe(time.perf_counter() - started)
        return reply

    def _send_done(self) -> None:
        while True:
            try:
                identity, reply = self._done.get_nowait()
            except queue.Empty:
                return
            self._send(identity, reply)

    def _send(self, identity: bytes, payload: bytes) -> None:
        if self._sock is None:
            return
        try:
            # Not blocking: a client that stopped reading loses its replies
            # (ROUTER drops at the high-water mark), nobody else waits; and
            # what it leaves unread is bounded in bytes too (.replies).
            if not self.replies.send(self._sock, identity, payload):
                self.metrics.bound_refusals.labels(bound="queued_reply_bytes").inc()
                self._count_error(p.E_BUSY)
        except zmq.ZMQError as exc:
            logger.debug("reply dropped: %s", exc)
            self._count_error("send")

    def _housekeeping(self) -> None:
        try:
            expired = self.engine.expire_leases()
            if expired:
                logger.info("%d leases expired", expired)
            for session in self.sessions.idle():
                self.handlers.reclaim(session)
            self.replies.sweep()
        except Exception:
            logger.exception("housekeeping failed")
            self._count_error(p.E_INTERNAL)

    def _client_gone(self, session_id: str) -> None:
        """The liveness connection of a session closed: its process is gone."""
        session = self.sessions.remove(session_id)
        if session is not None:
            self.handlers.reclaim(session)

    def _count_error(self, kind: str) -> None:
        self.metrics.errors.labels(kind=kind).inc()

    # -- introspection ------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """The ``/status`` document (see :mod:`.http`)."""
        stats = self.handlers.stats_dict()
        leases = self.engine.lease_counts()
        now = time.monotonic()
        arena = self.engine.arena
        sessions = self.sessions.sessions()
        status: dict[str, Any] = {
            "version": self.handlers.server_version,
            "protocol_version": p.PROTOCOL_VERSION,
            "ready": self.ready,
            "endpoint": self.endpoint,
            "uptime_seconds": round(time.time() - self.started, 3),
            "chunk_size": self.config.chunk_size,
            "transfer_modes": sorted(m.value for m in self.handlers.transfer_modes),
            "gpu_fault": self._ipc.fault if self._ipc is not None else "",
            "arena": {"name": arena.name, "size_bytes": arena.size},
            "tiers": stats["tiers"],
            "counters": stats["counters"],
            "leases_active": stats["leases_active"],
            "clients_connected": len(sessions),
        }
        if self.config.server.status_detail:
            # Who is connected, for an operator on the pod's own port; session
            # ids are never shown (they are the key to a client's leases).
            status["clients"] = [
                {
                    "client_id": s.client_id,
                    "role": s.role,
                    "pid": s.pid,
                    "idle_seconds": round(now - s.last_seen, 3),
                    "requests": s.requests,
                    "leases": leases.get(s.session_id, 0),
                }
                for s in sessions
            ]
        return status
