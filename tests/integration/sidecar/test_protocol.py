"""Encoding and validation of every protocol message, in process (no sockets)."""

from __future__ import annotations

import msgpack
import pytest

from kvstrata.sidecar import protocol as p
from kvstrata.sidecar.transfer_mode import TransferMode

KEY = b"\x01" * 16 + b"\x02" * 32
SLOT = p.SlotInfo(lease_id=3, offset=4096, length=512, dtype="bfloat16", shape=(2, 16, 8))

REQUESTS = [
    p.HelloRequest("c1", "worker", b"f" * 16, {"model": "m", "tp_rank": 0}, TransferMode.HOST, 42),
    p.HelloRequest(
        "c2", "scheduler", b"f" * 16, None, TransferMode.HOST, 42, [b"g" * 16, b"h" * 16]
    ),
    p.LookupRequest([KEY, KEY], True, "req-1"),
    p.LookupRequest([KEY, KEY, KEY, KEY], True, "req-1", groups=2),
    p.PrepareStoreRequest([KEY], 512, "bfloat16", (2, 16, 8), "req-1"),
    p.CommitStoreRequest([3, 4], [True, False]),
    p.PrepareRetrieveRequest([KEY], "req-1"),
    p.PrepareRetrieveRequest([KEY, KEY, KEY], "step", [1, 2]),
    p.ReleaseRequest([3]),
    p.EndRequestRequest("req-1"),
    p.PingRequest(),
    p.StatsRequest(),
]

REPLIES = [
    (p.HELLO, p.HelloReply("s", "kvstrata-1", 1 << 20, 256, "0.1.0", TransferMode.HOST, 30.0)),
    (p.LOOKUP, p.LookupReply(2, ["l1", "l2"])),
    (p.PREPARE_STORE, p.SlotsReply([SLOT, None])),
    (p.COMMIT_STORE, p.CommitStoreReply([True, False])),
    (p.PREPARE_RETRIEVE, p.SlotsReply([SLOT])),
    (p.RELEASE, p.CountReply(1)),
    (p.END_REQUEST, p.CountReply(0)),
    (p.PING, p.PingReply("0.1.0", True)),
    (p.STATS, p.StatsReply({"tiers": {}, "counters": {"lookups_total": 1}})),
]


@pytest.mark.parametrize("body", REQUESTS, ids=lambda b: type(b).__name__)
def test_every_request_survives_encoding_unchanged(body: p.Message):
    frame = p.encode_request(body.op, 9, "session", body)
    request = p.decode_request([frame])
    assert (request.request_id, request.op, request.session_id) == (9, body.op, "session")
    assert request.body == body


@pytest.mark.parametrize(("op", "body"), REPLIES, ids=lambda x: x if isinstance(x, str) else "")
def test_every_reply_survives_encoding_unchanged(op: str, body: p.Message):
    reply = p.decode_reply([p.encode_reply(5, body)], op)
    assert (reply.request_id, reply.ok) == (5, True)
    assert reply.body == body


def test_an_error_reply_decodes_to_its_code_and_message():
    reply = p.decode_reply([p.encode_error(5, p.E_BAD_REQUEST, "field 'keys': nope")], p.LOOKUP)
    assert reply.ok is False
    assert reply.body == p.ErrorReply(p.E_BAD_REQUEST, "field 'keys': nope")


def test_a_reply_with_a_malformed_slot_is_refused_naming_it():
    bad = msgpack.packb([1, 5, True, {"slots": [[1, 2, "x", "u8", []]]}])
    with pytest.raises(p.ProtocolError, match=r"slots\[0\]\.length") as info:
        p.decode_reply([bad], p.PREPARE_RETRIEVE)
    assert info.value.request_id == 5


def test_a_request_error_carries_the_request_id_it_could_read():
    frame = msgpack.packb([1, 77, p.RELEASE, "s", {"lease_ids": ["one"]}])
    with pytest.raises(p.ProtocolError, match=r"lease_ids\[0\]") as info:
        p.decode_request([frame])
    assert (info.value.code, info.value.request_id) == (p.E_BAD_REQUEST, 77)


def test_peek_request_id_reads_the_id_of_any_envelope_and_minus_one_of_garbage():
    assert p.peek_request_id(p.encode_error(12, p.E_INTERNAL, "x")) == 12
    assert p.peek_request_id(b"\xc1") == -1
