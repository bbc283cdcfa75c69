"""Malformed frames against a real sidecar over a raw ZeroMQ DEALER socket.

Every frame gets a reply (an error naming what was wrong unless the frame
happened to be a valid request), the sidecar keeps serving, and chunks
stored before the fuzzing come back intact afterwards.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstrata.sidecar import protocol as p

NBYTES = 8192
REPLY_TIMEOUT_MS = 3000
ERROR_CODES = {
    p.E_BAD_FRAME,
    p.E_BAD_VERSION,
    p.E_UNKNOWN_OP,
    p.E_BAD_REQUEST,
    p.E_NO_SESSION,
    p.E_UNSUPPORTED,
    p.E_BUSY,
}


class RawPeer:
    """A DEALER that sends arbitrary frames and reads the reply envelope."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def ask(self, frames: list[bytes]) -> list[Any]:
        self.sock.send_multipart(frames)
        assert self.sock.poll(REPLY_TIMEOUT_MS), f"no reply to {frames!r:.200}"
        reply = self.sock.recv_multipart()
        assert len(reply) == 1
        envelope = msgpack.unpackb(reply[0], raw=False)
        assert isinstance(envelope, list) and len(envelope) == 4
        assert envelope[0] == p.PROTOCOL_VERSION
        assert isinstance(envelope[2], bool) and isinstance(envelope[3], dict)
        return envelope

    def error(self, frames: list[bytes]) -> tuple[str, str]:
        _, _, ok, body = self.ask(frames)
        assert ok is False, body
        assert body["code"] in ERROR_CODES, body
        assert body["message"], body
        return body["code"], body["message"]

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory, kit: Any) -> Iterator[dict[str, Any]]:
    """A sidecar with chunks stored before any fuzzing, and a raw peer with a session."""
    sidecar = kit.Sidecar(tmp_path_factory.mktemp("fuzz") / "sc", {"l1": {"size_bytes": "32Mi"}})
    sidecar.start()
    client = sidecar.client()
    keys = kit.make_keys(8, seed=99)
    assert kit.store(client, keys, NBYTES, owner="before-fuzz") == 8
    peer = RawPeer(sidecar.endpoint)
    hello = p.HelloRequest(client_id="fuzzer", role="worker", fingerprint=keys[0][:16])
    _, _, ok, body = peer.ask([p.encode_request(p.HELLO, 1, "", hello)])
    assert ok, body
    try:
        yield {"sidecar": sidecar, "client": client, "keys": keys, "peer": peer, "session": body}
    finally:
        peer.close()
        client.close()
        sidecar.stop()
        sidecar.cleanup()


def _valid(op: str, session: str, body: dict[str, Any], version: int = 1) -> bytes:
    return msgpack.packb([version, 7, op, session, body])


KEY = b"k" * 48


def _cases(session: str) -> dict[str, tuple[list[bytes], str, str]]:
    """name -> (frames, expected code, text the message must contain)."""
    lookup = {"keys": [KEY], "prefetch": False, "owner": "o"}
    return {
        "random bytes": ([b"\x93\x00\xc1garbage"], p.E_BAD_FRAME, "msgpack"),
        "an empty frame": ([b""], p.E_BAD_FRAME, "msgpack"),
        "two frames": ([_valid(p.PING, "", {}), b"x"], p.E_BAD_FRAME, "2"),
        "a map instead of the envelope": ([msgpack.packb({"op": 1})], p.E_BAD_FRAME, "array"),
        "a truncated request": ([_valid(p.LOOKUP, session, lookup)[:-5]], p.E_BAD_FRAME, ""),
        "a declared 4G array": ([b"\xdd\xff\xff\xff\xff"], p.E_BAD_FRAME, "max_array_len"),
        "a declared 4G map": ([b"\xdf\xff\xff\xff\xff"], p.E_BAD_FRAME, "msgpack"),
        "a declared 4G binary": ([b"\x95\x01\x01\xc6\xff\xff\xff\xff"], p.E_BAD_FRAME, ""),
        "a declared 4G string": ([b"\x95\x01\x01\xdb\xff\xff\xff\xff"], p.E_BAD_FRAME, ""),
        "an unknown version": ([_valid(p.PING, "", {}, version=99)], p.E_BAD_VERSION, "99"),
        "a string version": ([msgpack.packb(["1", 7, p.PING, "", {}])], p.E_BAD_VERSION, "1"),
        "an unknown op": ([_valid("EXPLODE", session, {})], p.E_UNKNOWN_OP, "EXPLODE"),
        "an op of the wrong type": ([_valid(3, session, {})], p.E_UNKNOWN_OP, "3"),  # type: ignore[arg-type]
        "a negative request id": ([msgpack.packb([1, -4, p.PING, "", {}])], p.E_BAD_FRAME, "id"),
        "a missing field": (
            [_valid(p.LOOKUP, session, {"keys": [KEY], "owner": "o"})],
            p.E_BAD_REQUEST,
            "prefetch",
        ),
        "keys of the wrong type": (
            [_valid(p.LOOKUP, session, {**lookup, "keys": "abc"})],
            p.E_BAD_REQUEST,
            "keys",
        ),
        "a key of the wrong length": (
            [_valid(p.LOOKUP, session, {**lookup, "keys": [KEY, b"short"]})],
            p.E_BAD_REQUEST,
            "keys[1]",
        ),
        "too many keys": (
            [_valid(p.LOOKUP, session, {**lookup, "keys": [KEY] * (p.MAX_KEYS + 1)})],
            p.E_BAD_FRAME,  # refused by the unpacker's array limit before validation
            "max_array_len",
        ),
        "a bool where an int belongs": (
            [_valid(p.RELEASE, session, {"lease_ids": [True]})],
            p.E_BAD_REQUEST,
            "lease_ids[0]",
        ),
        "mismatched commit lists": (
            [_valid(p.COMMIT_STORE, session, {"lease_ids": [1, 2], "ok": [True]})],
            p.E_BAD_REQUEST,
            "differ",
        ),
        "a huge nbytes": (
            [
                _valid(
                    p.PREPARE_STORE,
                    session,
                    {"keys": [KEY], "nbytes": 1 << 50, "dtype": "u8", "shape": [], "owner": "o"},
                )
            ],
            p.E_BAD_REQUEST,
            "nbytes",
        ),
        "a shape of too many dims": (
            [
                _valid(
                    p.PREPARE_STORE,
                    session,
                    {"keys": [KEY], "nbytes": 8, "dtype": "u8", "shape": [1] * 9, "owner": "o"},
                )
            ],
            p.E_BAD_REQUEST,
            "shape",
        ),
        "an unknown session": ([_valid(p.LOOKUP, "nope", lookup)], p.E_NO_SESSION, "HELLO"),
        "an unsupported transfer mode": (
            [
                _valid(
                    p.HELLO,
                    "",
                    {"client_id": "c", "role": "w", "fingerprint": b"f" * 16, "transfer_mode": "x"},
                )
            ],
            p.E_UNSUPPORTED,
            "transfer_mode",
        ),
    }


CASE_NAMES = list(_cases("s"))


@pytest.mark.parametrize("case", CASE_NAMES)
def test_malformed_frame_gets_an_error_reply_naming_the_problem(target: dict, case: str):
    frames, code, text = _cases(target["session"]["session_id"])[case]
    got_code, message = target["peer"].error(frames)
    assert got_code == code, message
    assert text in message


_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=12)
    | st.binary(max_size=64)
)
_values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5)
    ),
    max_leaves=16,
)
_ops = st.sampled_from(sorted(p.REQUESTS)) | st.text(max_size=10)
_field_names = st.sampled_from(
    ["keys", "prefetch", "owner", "nbytes", "dtype", "shape", "lease_ids", "ok", "client_id",
     "role", "fingerprint", "transfer_mode", "pid", "namespace"]
)  # fmt: skip
_bodies = st.dictionaries(_field_names, _values | st.lists(st.binary(min_size=40, max_size=56)))


@settings(
    max_examples=250,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    kind=st.sampled_from(["bytes", "value", "envelope"]),
    blob=st.binary(max_size=300),
    value=_values,
    op=_ops,
    body=_bodies,
    version=st.sampled_from([1, 1, 1, 0, 2, -1]),
    use_session=st.booleans(),
    cut=st.integers(min_value=0, max_value=400),
)
def test_random_frames_always_get_a_reply_and_never_stop_the_server(
    target: dict, kind: str, blob: bytes, value: Any, op: str, body: dict, version: int,
    use_session: bool, cut: int,
):  # fmt: skip
    session = target["session"]["session_id"] if use_session else ""
    if kind == "bytes":
        frame = blob
    elif kind == "value":
        frame = msgpack.packb(value)
    else:
        frame = msgpack.packb([version, 11, op, session, body])
        if cut < len(frame) and cut % 3 == 0:
            frame = frame[:cut]
    _, _, ok, reply = target["peer"].ask([frame])
    if not ok:
        assert reply["code"] in ERROR_CODES | {p.E_INTERNAL}, reply
        assert reply["code"] != p.E_INTERNAL, f"server bug on {frame!r:.300}: {reply}"


def test_seeded_byte_flips_of_valid_requests_get_replies(target: dict):
    rng = random.Random(1234)
    session = target["session"]["session_id"]
    keys = target["keys"]
    valid = [
        _valid(p.LOOKUP, session, {"keys": keys, "prefetch": True, "owner": "f"}),
        _valid(p.PREPARE_RETRIEVE, session, {"keys": keys[:2], "owner": "f"}),
        _valid(p.RELEASE, session, {"lease_ids": [1, 2, 3]}),
        _valid(p.END_REQUEST, session, {"owner": "f"}),
        _valid(p.STATS, session, {}),
    ]
    peer = target["peer"]
    for _ in range(400):
        frame = bytearray(rng.choice(valid))
        for _ in range(rng.randint(1, 4)):
            frame[rng.randrange(len(frame))] = rng.randrange(256)
        _, _, ok, reply = peer.ask([bytes(frame)])
        assert ok or reply["code"] in ERROR_CODES, reply
    peer.ask([_valid(p.END_REQUEST, session, {"owner": "f"})])


def test_chunks_stored_before_the_fuzzing_come_back_intact(target: dict, kit: Any):
    """Runs last in this module (pytest keeps definition order): after every
    frame above, the server still serves and the stored chunks are unchanged."""
    client = target["client"]
    assert client.ping()
    expected = [kit.payload(k, NBYTES) for k in target["keys"]]
    assert kit.retrieve(client, target["keys"], owner="after-fuzz") == expected
    assert target["sidecar"].get("/readyz").strip() == "ready"
    assert target["sidecar"].proc.poll() is None
