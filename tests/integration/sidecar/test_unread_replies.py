"""A client that asks and never reads cannot pin the sidecar's memory.

A real sidecar with its default ``server.max_queued_reply_bytes`` (64 MiB).
A real client stores enough chunks that an EVENTS reply is a few hundred
KB; a raw ZeroMQ peer that takes almost nothing off its connection
(receive high-water mark 1) then asks for the whole feed again and again,
well past the bound in bytes. The sidecar answers every request, queues
replies for the peer only up to the bound, counts each reply it dropped,
and keeps serving the well-behaved client. When the peer finally reads, it
finds full replies and then a short ``busy`` error for each dropped one;
once it disconnects, nothing is left queued.
"""

from __future__ import annotations

import os
from typing import Any

import msgpack
import zmq

from kvstrata.sidecar import protocol as p

DEFAULT_BOUND = 64 << 20  # server.max_queued_reply_bytes's default
CHUNKS = 4096  # each stored chunk is one or two EVENTS records
NBYTES = 512
ASKS = 300  # EVENTS requests sent without reading: well past the bound


def _sample(sidecar: Any, prefix: str, missing: float | None = None) -> float:
    for line in sidecar.get("/metrics").splitlines():
        if line.startswith(prefix + " "):
            return float(line.rsplit(" ", 1)[1])
    if missing is not None:
        return missing
    raise AssertionError(f"/metrics has no {prefix}")


def _answered(sidecar: Any, op: str) -> float:
    return _sample(sidecar, f'kvstrata_operation_duration_seconds_count{{op="{op}"}}')


def _request(op: str, request_id: int, session_id: str, body: dict[str, Any]) -> bytes:
    return msgpack.packb([p.PROTOCOL_VERSION, request_id, op, session_id, body])


def test_replies_a_client_leaves_unread_are_bounded_in_bytes_and_counted(sidecar: Any, kit: Any):
    client = sidecar.client(call_timeout_s=10.0)
    ctx = zmq.Context.instance()
    hog = ctx.socket(zmq.DEALER)
    hog.setsockopt(zmq.LINGER, 0)
    hog.setsockopt(zmq.RCVHWM, 1)
    hog.setsockopt(zmq.RCVBUF, 4096)
    hog.setsockopt(zmq.RCVTIMEO, 10_000)
    hog.connect(sidecar.endpoint)
    try:
        hello = {"client_id": "hog", "role": "worker", "transfer_mode": "host",
                 "fingerprint": kit.NAMESPACE.fingerprint(), "pid": os.getpid()}  # fmt: skip
        hog.send(_request(p.HELLO, 1, "", hello))
        session = msgpack.unpackb(hog.recv())[3]["session_id"]
        events = {"after": 0, "limit": p.MAX_EVENTS}
        hog.send(_request(p.EVENTS, 2, session, events))  # from now on the tiers are journaled
        assert msgpack.unpackb(hog.recv())[2]

        keys = kit.make_keys(CHUNKS, seed=382)
        assert kit.store(client, keys, NBYTES, owner="w") == CHUNKS
        hog.send(_request(p.EVENTS, 3, session, events))
        one_reply = len(hog.recv())
        assert one_reply > 64 << 10  # a few hundred KB: the bound is reached in a few hundred

        before = _answered(sidecar, p.EVENTS)
        for n in range(ASKS):
            hog.send(_request(p.EVENTS, 1000 + n, session, events))
        kit.wait_until(
            lambda: _answered(sidecar, p.EVENTS) >= before + ASKS,
            timeout=120,
            what="the sidecar answering every EVENTS request",
        )

        # What is queued for the peer now, before it reads.
        queued = _sample(sidecar, "kvstrata_queued_reply_bytes", missing=-1.0)
        # The well-behaved client is served meanwhile.
        assert kit.retrieve(client, keys[:8], owner="r") == [
            kit.payload(k, NBYTES) for k in keys[:8]
        ]

        # Reading now: full replies first, then one short busy error per reply
        # past the bound (a few more than the bound sat in the peer's
        # connection and its own small pipe).
        replies = [msgpack.unpackb(hog.recv()) for _ in range(ASKS)]
        busy = [r for r in replies if not r[2]]
        assert len(busy) >= ASKS - DEFAULT_BOUND // one_reply - 4
        assert {r[3]["code"] for r in busy} == {p.E_BUSY}
        assert "server.max_queued_reply_bytes" in busy[0][3]["message"]
        assert all(r[2] for r in replies[: ASKS - len(busy)])
        assert sorted(r[1] for r in replies) == list(range(1000, 1000 + ASKS))
        # Counted, and the bytes queued never passed the bound.
        dropped = _sample(
            sidecar, 'kvstrata_client_bound_refusals_total{bound="queued_reply_bytes"}'
        )
        assert dropped == len(busy)
        assert 0 <= queued <= DEFAULT_BOUND
    finally:
        hog.close(0)
    kit.wait_until(
        lambda: _sample(sidecar, "kvstrata_queued_reply_bytes") == 0,
        timeout=30,
        what="nothing queued once the peer has gone",
    )
    assert client.ping()
    client.close()
