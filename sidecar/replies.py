"""Bytes of replies waiting for each client: bounded, so one client that never
reads cannot pin the sidecar's memory.

Why: ZeroMQ keeps a reply in the peer's outbound pipe until the peer's
connection takes it, and a ROUTER's high-water mark counts messages, not
bytes. A client that sends EVENTS (a reply of up to a few hundred KB) and
never reads would pin ``SNDHWM`` of them: gigabytes, then an OOM kill of the
cache for every client. So the server owns a byte count per peer:

* a reply of at least :data:`TRACKED_MIN_BYTES` is sent zero-copy with a
  tracker (pyzmq's ``MessageTracker``: done once libzmq has let go of the
  bytes, i.e. written them into the connection or dropped them because the
  peer is gone), and counts against its peer until then;
* a reply that would take its peer past ``server.max_queued_reply_bytes`` is
  not queued: the peer gets a short ``busy`` error with the request's id
  instead (counted as ``queued_reply_bytes`` in
  ``kvstrata_client_bound_refusals_total``);
* smaller replies are bounded by the socket's high-water mark
  (:data:`SNDHWM` of them, under :data:`TRACKED_MIN_BYTES` each).

A peer's count falls as its connection drains (the sidecar's ROUTER has
``LINGER`` 0, so the pipe of a peer that disconnected is emptied at once).

Owned by the server loop's thread (:meth:`QueuedReplies.send` is how the
server sends every reply): not thread-safe, except :meth:`QueuedReplies.total`
for ``/metrics``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq

from kvstrata.sidecar import protocol as p

__all__ = ["SNDHWM", "TRACKED_MIN_BYTES", "QueuedReplies", "request_id_of"]

# Replies this size or larger are tracked; smaller ones are bounded by SNDHWM
# alone (1,024 of them: at most 4 MiB per peer).
TRACKED_MIN_BYTES = 4096
# Replies queued per peer before ZeroMQ drops more: well above what a client
# that reads keeps in flight (the server's pool takes 1,024 requests at once).
SNDHWM = 1024


def request_id_of(reply: bytes) -> int:
    """The request id of an encoded reply ``[version, request_id, ok, body]``,
    read without decoding its body (0 if the frame is not one)."""
    unpacker = msgpack.Unpacker()
    unpacker.feed(reply[:32])  # version and request id fit, whatever the body
    try:
        unpacker.read_array_header()
        unpacker.skip()
        request_id = unpacker.unpack()
    except (msgpack.OutOfData, ValueError):
        return 0
    return request_id if isinstance(request_id, int) else 0


@dataclass
class _Peer:
    queued: int = 0
    pending: deque[tuple[zmq.MessageTracker, int]] = field(default_factory=deque)

    def reap(self) -> None:
        """Forget the replies libzmq has let go of (done in the order sent)."""
        while self.pending and self.pending[0][0].done:
            self.queued -= self.pending.popleft()[1]


class QueuedReplies:
    """Per-peer bytes of tracked replies not yet taken by the peer."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._peers: dict[bytes, _Peer] = {}

    def admit(self, identity: bytes, nbytes: int) -> bool:
        """Whether a reply of ``nbytes`` may be queued for this peer now."""
        peer = self._peers.get(identity)
        if peer is None:
            return nbytes <= self.max_bytes
        peer.reap()
        return peer.queued + nbytes <= self.max_bytes

    def send(self, sock: zmq.Socket[Any], identity: bytes, payload: bytes) -> bool:
        """Queue ``payload`` for peer ``identity`` on ROUTER ``sock`` without
        blocking; False when the peer had no room for it and got the short
        ``busy`` error instead (the caller counts it). Raises ``zmq.ZMQError``."""
        if len(payload) < TRACKED_MIN_BYTES:
            sock.send_multipart([identity, payload], zmq.NOBLOCK)
            return True
        if self.admit(identity, len(payload)):
            tracker = sock.send_multipart([identity, payload], zmq.NOBLOCK, copy=False, track=True)
            self.sent(identity, tracker, len(payload))
            return True
        message = (
            f"a reply of {len(payload)} bytes was dropped: this connection leaves up to "
            f"{self.max_bytes} bytes of replies unread (server.max_queued_reply_bytes); read them"
        )
        busy = p.encode_error(request_id_of(payload), p.E_BUSY, message)
        sock.send_multipart([identity, busy], zmq.NOBLOCK)
        return False

    def sent(self, identity: bytes, tracker: zmq.MessageTracker, nbytes: int) -> None:
        """A tracked reply of ``nbytes`` was handed to ZeroMQ for this peer."""
        peer = self._peers.setdefault(identity, _Peer())
        peer.pending.append((tracker, nbytes))
        peer.queued += nbytes

    def sweep(self) -> None:
        """Forget peers whose replies are all taken (call it now and then)."""
        for identity in list(self._peers):
            peer = self._peers[identity]
            peer.reap()
            if not peer.pending:
                del self._peers[identity]

    def total(self) -> int:
        """Bytes queued for all peers, as last reaped (``/metrics``)."""
        return sum(peer.queued for peer in list(self._peers.values()))

    def peers(self) -> int:
        return len(self._peers)
