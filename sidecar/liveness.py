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
import grp
import logging
import os
import selectors
import socket
import threading
from collections.abc import Callable, Iterator

logger = logging.getLogger(__name__)

SUFFIX = ".live"
MAX_LINE = 128  # a session id and a newline fit with room to spare


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


def ipc_path(endpoint: str) -> str | None:
    """The socket file of an ``ipc://`` endpoint (None for tcp or abstract sockets)."""
    if not endpoint.startswith("ipc://"):
        return None
    path = endpoint[len("ipc://") :]
    return None if path.startswith("@") else path


def liveness_path(ipc_socket_path: str) -> str:
    return ipc_socket_path + SUFFIX


class LivenessListener:
    """Accepts liveness connections; calls ``on_gone(session_id)`` when one closes.

    ``on_gone`` runs on the listener's thread and must be thread-safe.
    """

    def __init__(self, path: str, on_gone: Callable[[str], None], group: str | None = None) -> None:
        self.path = path
        self.group = group
        self.on_gone = on_gone
        self._sel = selectors.DefaultSelector()
        self._listener: socket.socket | None = None
        self._sessions: dict[socket.socket, bytearray | str] = {}
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
        self._sel.register(sock, selectors.EVENT_READ, "accept")
        self._sel.register(self._stop_r, selectors.EVENT_READ, "stop")
        self._thread = threading.Thread(target=self._run, name="kvstrata-liveness", daemon=True)
        self._thread.start()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._stop_w, b"x")
        if self._thread is not None:
            self._thread.join(timeout=5)
        for conn in list(self._sessions):
            conn.close()
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
            for key, _ in self._sel.select():
                if key.data == "stop":
                    return
                if key.data == "accept":
                    self._accept()
                else:
                    self._read(key.fileobj)  # type: ignore[arg-type]

    def _accept(self) -> None:
        assert self._listener is not None  # registered only after start()
        try:
            conn, _ = self._listener.accept()
        except OSError:
            return
        conn.setblocking(False)
        self._sessions[conn] = bytearray()
        self._sel.register(conn, selectors.EVENT_READ, "conn")

    def _read(self, conn: socket.socket) -> None:
        try:
            data = conn.recv(MAX_LINE)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        state = self._sessions.get(conn)
        if data and isinstance(state, bytearray):
            state.extend(data)
            if b"\n" in state:
                line = bytes(state).split(b"\n", 1)[0]
                self._sessions[conn] = line.decode("ascii", "replace").strip()
            elif len(state) > MAX_LINE:
                data = b""  # not a client of ours: drop it
        if data:
            return  # anything after the id line is ignored
        self._sel.unregister(conn)
        conn.close()
        session_id = self._sessions.pop(conn, None)
        if isinstance(session_id, str) and session_id:
            try:
                self.on_gone(session_id)
            except Exception:
                logger.exception("ending a session whose process is gone failed")


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
