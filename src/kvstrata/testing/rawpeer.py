"""A bare ZeroMQ peer of a sidecar that sends any frame, well formed or not.

Why: the connector's client only sends what the protocol allows; tests of
what a sidecar does with a hostile or broken client need to send frames the
client never would (wrong types, oversized bodies, no session) and read the
raw reply envelope back. One DEALER socket per peer, as a client has.
"""

from __future__ import annotations

import os
from typing import Any

import msgpack
import zmq

from kvstrata.sidecar import protocol as p


class RawPeer:
    """One DEALER connection to ``endpoint``; ``close()`` when done."""

    def __init__(self, endpoint: str, timeout_s: float = 10.0) -> None:
        self._ctx = zmq.Context.instance()
        self.sock = self._ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
        self.sock.connect(endpoint)
        self.session_id = ""

    def send(self, frame: bytes) -> None:
        self.sock.send(frame)

    def send_request(self, op: str, body: dict[str, Any], request_id: int = 1,
                     session_id: str | None = None) -> None:  # fmt: skip
        sid = self.session_id if session_id is None else session_id
        self.send(msgpack.packb([p.PROTOCOL_VERSION, request_id, op, sid, body]))

    def receive(self) -> list[Any]:
        """The next reply envelope ``[version, request_id, ok, body]`` (raises
        ``zmq.Again`` when none comes within the timeout)."""
        return list(msgpack.unpackb(self.sock.recv(), raw=False))

    def call(self, op: str, body: dict[str, Any], request_id: int = 1,
             session_id: str | None = None) -> list[Any]:  # fmt: skip
        self.send_request(op, body, request_id, session_id)
        return self.receive()

    def hello(self, fingerprint: bytes, client_id: str = "raw", **extra: Any) -> str:
        """Open a session in ``fingerprint``'s namespace; returns its id."""
        body = {"client_id": client_id, "role": "worker", "fingerprint": fingerprint,
                "transfer_mode": "host", "pid": os.getpid(), **extra}  # fmt: skip
        reply = self.call(p.HELLO, body, session_id="")
        if not reply[2]:
            raise AssertionError(f"HELLO refused: {reply[3]}")
        self.session_id = str(reply[3]["session_id"])
        return self.session_id

    def close(self) -> None:
        self.sock.close(0)
