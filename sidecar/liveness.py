"""Know at once when a client process is gone.

Why: a worker in ``ipc`` mode has its KV tensors mapped in the sidecar
(CUDA IPC handles); while they stay open, the GPU memory of a vLLM that
died cannot be freed. ZeroMQ does not say which peer of a ROUTER went away
(libzmq's ``ZMQ_ROUTER_NOTIFY`` is a draft API, not in the released
library), and the idle timeout takes a minute. So each client also keeps
one plain Unix stream connection open to ``<socket path>.live`` and writes
its session id on it, one line. The kernel closes that connection when
the process ends for any reason (SIGKILL included); the sidecar reads end
of file and ends the session at once: leases reclaimed, IPC handles
closed. A client that is alive but silent is still reaped by the idle
timeout.

The file sits next to the ZeroMQ socket, in the pod's own socket
directory, with the same mode (0660, group ``server.socket_group``): the
same access rule (one pod is one trust domain). Only ``ipc://`` endpoints
have one.
"""

from __future__ import annotations

import contextlib
import errno
import grp
import logging
import os
import selectors
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator

from kvstrata.sidecar.fdbudget import ListenerCounts

logger = logging.getLogger(__name__)

SUFFIX = ".live"
MAX_LINE = 128  # a session id and a newline fit with room to spare
ID_DEADLINE_S = 5.0  # a client writes its id line right after connecting
ACCEPT_BURST = 16  # accepts per wake-up: each is judged before the next takes a descriptor
ACCEPT_BACKOFF_S = 0.5  # accepting pauses this long after running out of descriptors
_OUT_OF_DESCRIPTORS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


SOCKET_MODE = 0o660


@contextlib.contextmanager
def socket_umask() -> Iterator[None]:
    """Socket files created inside are at most :data:`SOCKET_MODE` (the umask is
    process-wide: only used while the sidecar starts, before other threads)."""
    old = os.umask(0o777 & ~SOCKET_MODE)
    try:
        yield
    finally:
        os.umask(old)


def restrict_socket_file(path: str, group: str | None) -> None:
    """``chmod 0660`` and, when ``server.socket_group`` is set, hand the file to that group."""
    if group is not None:
        gid = int(group) if group.isdigit() else grp.getgrnam(group).gr_gid
        os.chown(path, -1, gid)
    os.chmod(path, SOCKET_MODE)


def liveness_path(ipc_socket_path: str) -> str:
    return ipc_socket_path + SUFFIX


class LivenessListener:
    """Accepts liveness connections; calls ``on_gone(session_id)`` when one closes.

    ``on_gone`` runs on the listener's thread and must be thread-safe. Limits
    (they keep this socket from taking the descriptors ZeroMQ needs, see
    :mod:`.fdbudget`): at most ``max_connections`` open; a connection must
    send its id line within :data:`ID_DEADLINE_S` and name a session
    ``known`` accepts, or it is closed; at the cap, the oldest connection
    that has not yet identified itself is closed to make room, or the
    newcomer is. An ``accept`` that fails for want of descriptors pauses
    accepting for :data:`ACCEPT_BACKOFF_S` instead of spinning on a listener
    that stays readable.
    """

    def __init__(
        self,
        path: str,
        on_gone: Callable[[str], None],
        group: str | None = None,
        *,
        max_connections: int = 1024,
        known: Callable[[str], bool] | None = None,
        counts: ListenerCounts | None = None,
    ) -> None:
        self.path = path
        self.group = group
        self.on_gone = on_gone
        self.known = known
        self.counts = counts if counts is not None else ListenerCounts(max_connections)
        self.counts.limit = max_connections
        self._sel = selectors.DefaultSelector()
        self._listener: socket.socket | None = None
        # Not yet identified, oldest first: (bytes so far, deadline).
        self._pending: OrderedDict[socket.socket, tuple[bytearray, float]] = OrderedDict()
        self._sessions: dict[socket.socket, str] = {}
        self._paused_until: float | None = None
        self._thread: threading.Thread | None = None
        self._stop_r, self._stop_w = os.pipe()

    def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with socket_umask():
                sock.bind(self.path)
            restrict_socket_file(self.path, self.group)
        except OSError:
            sock.close()
            raise
        sock.listen(128)
        sock.setblocking(False)
        self._listener = sock
        self.counts.listen_fd = sock.fileno()
        self._sel.register(sock, selectors.EVENT_READ, "accept")
        self._sel.register(self._stop_r, selectors.EVENT_READ, "stop")
        self._thread = threading.Thread(target=self._run, name="kvstrata-liveness", daemon=True)
        self._thread.start()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._stop_w, b"x")
        if self._thread is not None:
            self._thread.join(timeout=5)
        for conn in [*self._pending, *self._sessions]:
            conn.close()
        self._pending.clear()
        self._sessions.clear()
        if self._listener is not None:
            self._listener.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        self._sel.close()
        os.close(self._stop_r)
        os.close(self._stop_w)

    def _run(self) -> None:
        while True:
            for key, _ in self._sel.select(self._timeout()):
                if key.data == "stop":
                    return
                if key.data == "accept":
                    self._accept()
                else:
                    self._read(key.fileobj)  # type: ignore[arg-type]
            self._housekeeping()

    def _timeout(self) -> float | None:
        """Seconds until the next deadline (an unidentified connection's, or
        the end of an accept pause); None: nothing to wait for."""
        deadlines = [next(iter(self._pending.values()))[1]] if self._pending else []
        if self._paused_until is not None:
            deadlines.append(self._paused_until)
        return max(0.0, min(deadlines) - time.monotonic()) if deadlines else None

    def _housekeeping(self) -> None:
        now = time.monotonic()
        while self._pending:
            conn, (_, deadline) = next(iter(self._pending.items()))
            if deadline > now:
                break
            self.counts.idle_closed += 1
            self._drop(conn)
        if self._paused_until is not None and now >= self._paused_until:
            self._paused_until = None
            assert self._listener is not None  # paused only after start()
            self._sel.register(self._listener, selectors.EVENT_READ, "accept")

    def _accept(self) -> None:
        assert self._listener is not None  # registered only after start()
        for _ in range(ACCEPT_BURST):  # what one wake-up takes from the backlog
            try:
                conn, _ = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in _OUT_OF_DESCRIPTORS:
                    self._pause(exc)
                return  # ECONNABORTED and the like: that client is gone already
            if conn.fileno() >= self.counts.fd_ceiling:
                # On a descriptor of the reserve: the process is nearly out,
                # and libzmq aborts when it runs out (.fdbudget).
                self.counts.refused += 1
                conn.close()
                continue
            if self.counts.open >= self.counts.limit:
                if not self._pending:
                    self.counts.refused += 1
                    conn.close()
                    continue
                self.counts.made_room += 1
                self._drop(next(iter(self._pending)))
            conn.setblocking(False)
            self._pending[conn] = (bytearray(), time.monotonic() + ID_DEADLINE_S)
            self.counts.open += 1
            self._sel.register(conn, selectors.EVENT_READ, "conn")

    def _pause(self, exc: OSError) -> None:
        """No descriptor for a new connection: stop accepting for a while (the
        listener stays readable, so accepting at once again would spin)."""
        self.counts.accept_errors += 1
        if self._paused_until is None:
            logger.warning("liveness: accept failed (%s); pausing %.1fs", exc, ACCEPT_BACKOFF_S)
            self._sel.unregister(self._listener)  # type: ignore[arg-type]
        self._paused_until = time.monotonic() + ACCEPT_BACKOFF_S

    def _read(self, conn: socket.socket) -> None:
        try:
            data = conn.recv(MAX_LINE)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        pending = self._pending.get(conn)
        if pending is not None and data:
            state = pending[0]
            state.extend(data)
            if b"\n" in state:
                line = bytes(state).split(b"\n", 1)[0].decode("ascii", "replace").strip()
                del self._pending[conn]
                if line and (self.known is None or self.known(line)):
                    self._sessions[conn] = line
                    return
                data = b""  # no session of ours: not a client, drop it
            elif len(state) > MAX_LINE:
                data = b""  # not a client of ours: drop it
        if data:
            return  # anything after the id line is ignored
        session_id = self._sessions.get(conn)
        self._drop(conn)
        if session_id:
            try:
                self.on_gone(session_id)
            except Exception:
                logger.exception("ending a session whose process is gone failed")

    def _drop(self, conn: socket.socket) -> None:
        self._pending.pop(conn, None)
        self._sessions.pop(conn, None)
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(conn)
        conn.close()
        self.counts.open -= 1


def connect(path: str, session_id: str) -> socket.socket | None:
    """Open a client's liveness connection (None when the sidecar has none)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(1.0)
        sock.connect(path)
        sock.sendall(session_id.encode("ascii") + b"\n")
    except OSError:
        sock.close()
        return None
    return sock
