"""Our RESP packer sends exactly the bytes redis-py's own packer sends.

The Valkey tier swaps redis-py's command packer for one that keeps the
object header and payload as separate buffers (:class:`Scatter`), drawn
only while the command is sent; any difference on the wire would corrupt
commands, so compare byte for byte.
"""

from __future__ import annotations

import pytest
from redis.connection import Encoder, PythonRespSerializer

from kvstrata.sidecar.objformat import ChunkMeta, decode, encode_streamed
from kvstrata.sidecar.tiers.valkey_client import Scatter, _expanded, _ScatterPacker

CUTOFF = 6000
ENCODE = Encoder("utf-8", "strict", False).encode


def wire(chunks) -> bytes:
    return b"".join(bytes(c) for c in _expanded(chunks))


@pytest.mark.parametrize(
    "args",
    [
        ("PING",),
        ("CLUSTER INFO",),
        ("SET", "kvstrata:ab", b"small", "NX", "EX", 30),
        ("SET", "k", b"x" * 100_000),
        ("GET", b"k"),
        ("EXISTS", "a", "b", 3, 4.5),
    ],
)
def test_plain_commands_pack_to_the_same_bytes_as_redis_py(args) -> None:
    ours = _ScatterPacker(CUTOFF, ENCODE).pack(*args)
    theirs = PythonRespSerializer(CUTOFF, ENCODE).pack(*args)
    assert wire(ours) == wire(theirs)


def test_scatter_value_is_one_bulk_string_without_joining_its_buffers() -> None:
    header, payload = b"H" * 80, bytearray(b"P" * 70_000)
    chunks = _ScatterPacker(CUTOFF, ENCODE).pack("SET", "k", Scatter([header, payload]), "NX")
    expected = PythonRespSerializer(CUTOFF, ENCODE).pack("SET", "k", header + payload, "NX")
    assert wire(chunks) == wire(expected)
    # The payload travels as a view of the caller's buffer, not a copy.
    assert any(isinstance(c, memoryview) and c.obj is payload for c in _expanded(chunks))


@pytest.mark.parametrize("size", [10, 70_000, 600_000])
def test_streamed_object_is_one_bulk_string_with_its_trailer(size) -> None:
    key, payload = b"k" * 40, bytes(range(256)) * (size // 256 + 1)
    obj = encode_streamed(key, payload[:size], ChunkMeta())
    chunks = _ScatterPacker(CUTOFF, ENCODE).pack("SET", "name", Scatter(obj), "NX")
    value = b"".join(bytes(p) for p in encode_streamed(key, payload[:size], ChunkMeta()).pieces())
    expected = PythonRespSerializer(CUTOFF, ENCODE).pack("SET", "name", value, "NX")
    assert wire(chunks) == wire(expected)
    assert bytes(decode(value, expected_key=key).payload) == payload[:size]
