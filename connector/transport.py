"""The client's ZeroMQ transport: one DEALER socket per client, in one
process-wide context, optionally with CURVE keys.

Why apart from :mod:`.client`: the client decides what to send and what a
reply means; this module only makes the socket and gets a frame out within
a deadline without piling requests up for a sidecar that is down.

No vLLM or kopf imports here.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import zmq

from kvstrata.sidecar import protocol as p
from kvstrata.sidecar.endpoint import listening

__all__ = ["CONNECT_WAIT_S", "Channel", "CurveKeys"]

# How long a send waits for a connection to exist once the socket has been
# connected before (ZeroMQ reconnects in the background, so a sidecar that
# is up again is usually connected by the time of the next call; one that is
# down should cost a caller little). A fresh socket waits up to the deadline.
CONNECT_WAIT_S = 0.05

_context_lock = threading.Lock()
_context: zmq.Context[Any] | None = None


def _zmq_context() -> zmq.Context[Any]:
    """One ZeroMQ context per process for every client, created on first use.

    Never terminated: a per-client context would be terminated by its
    ``__del__`` when a client is dropped without :meth:`SidecarClient.close`,
    and ``term()`` blocks the collecting thread (possibly vLLM's) while a
    socket of that client is still open.
    """
    global _context
    with _context_lock:
        if _context is None:
            _context = zmq.Context()
        return _context


@dataclass(frozen=True, slots=True)
class CurveKeys:
    """ZeroMQ CURVE keys of a client (z85): the server's public key and our pair."""

    server_public: bytes
    public: bytes
    secret: bytes

    @classmethod
    def load(cls, server_cert: str, client_cert: str) -> CurveKeys:
        """From certificate files as ``zmq.auth`` writes them (the client's with its secret)."""
        import zmq.auth

        server_public, _ = zmq.auth.load_certificate(server_cert)
        public, secret = zmq.auth.load_certificate(client_cert)
        if not secret:
            raise ValueError(f"{client_cert} holds no secret key")
        return cls(server_public, public, secret)


class Channel:
    """One DEALER socket to ``endpoint``, made on first use (not thread-safe:
    the client calls it under its lock)."""

    def __init__(self, endpoint: str, curve: CurveKeys | None) -> None:
        self.endpoint = endpoint
        self.curve = curve
        self._sock: zmq.Socket[Any] | None = None
        self._ever_sent = False  # whether this socket was ever connected

    def socket(self) -> zmq.Socket[Any]:
        if self._sock is None:
            sock = _zmq_context().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            # Queue only to live connections: a send while the sidecar is down
            # fails at once instead of piling up requests for a dead peer.
            sock.setsockopt(zmq.IMMEDIATE, 1)
            sock.setsockopt(zmq.RECONNECT_IVL, 50)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
            sock.setsockopt(zmq.MAXMSGSIZE, 64 * p.MAX_MESSAGE_BYTES)
            if self.curve is not None:
                sock.curve_serverkey = self.curve.server_public
                sock.curve_publickey = self.curve.public
                sock.curve_secretkey = self.curve.secret
            sock.connect(self.endpoint)
            self._sock = sock
        return self._sock

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None

    def not_listening(self) -> bool:
        """Nothing was ever sent and nothing is bound at the ``ipc://`` endpoint
        (no socket file; for ``ipc://@NAME``, no such abstract socket)."""
        if self._ever_sent:
            return False
        return listening(self.endpoint) is False

    def send(self, frame: bytes, deadline: float) -> bool:
        """Send one frame; False when no connection takes it in time (a socket
        that was connected before waits ``CONNECT_WAIT_S`` at most)."""
        sock = self.socket()
        if self._ever_sent:
            wait_until = min(deadline, time.monotonic() + CONNECT_WAIT_S)
        else:
            wait_until = deadline
        while True:
            try:
                sock.send(frame, zmq.NOBLOCK)
                self._ever_sent = True
                return True
            except zmq.Again:
                remaining_ms = (wait_until - time.monotonic()) * 1000
                if remaining_ms <= 0 or not sock.poll(remaining_ms, zmq.POLLOUT):
                    return False
