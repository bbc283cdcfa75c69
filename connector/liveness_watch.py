"""The client's end of its session's liveness connection: whether the sidecar process is gone.

Why a module of its own: a call waiting for its reply also watches this
connection (``ipc://`` endpoints only, see :mod:`kvstrata.sidecar.liveness`).
The sidecar never writes on it; the kernel closes it when the sidecar
process ends, however it ends (SIGKILL included), so readable-and-closed
means no reply will come and the call can end as a miss at once instead of
at its deadline.
"""

from __future__ import annotations

import contextlib
import socket

from kvstrata.sidecar import liveness
from kvstrata.sidecar.endpoint import ipc_path

__all__ = ["LivenessWatch", "closed_by_peer"]


def closed_by_peer(live: socket.socket) -> bool:
    """Whether the sidecar's end of a liveness connection is closed."""
    try:
        return live.recv(64, socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, TimeoutError):  # open, nothing to read
        return False
    except OSError:  # reset: gone as well
        return True


class LivenessWatch:
    """At most one liveness connection: the current session's."""

    def __init__(self, endpoint: str) -> None:
        self._path = ipc_path(endpoint)
        self.socket: socket.socket | None = None

    def open(self, session_id: str) -> None:
        """Hold the sidecar's liveness connection for ``session_id`` (none
        for endpoints other than ``ipc://``, or when the sidecar has none)."""
        self.close()
        if self._path is not None:
            self.socket = liveness.connect(liveness.liveness_path(self._path), session_id)
            if self.socket is not None:
                # Only ever read to see whether it closed: never wait on it.
                self.socket.setblocking(False)

    def close(self) -> None:
        if self.socket is not None:
            with contextlib.suppress(OSError):
                self.socket.close()
            self.socket = None

    def sidecar_gone(self) -> bool:
        """Whether the sidecar of the watched session has ended (False while none is watched)."""
        return self.socket is not None and closed_by_peer(self.socket)
