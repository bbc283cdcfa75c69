"""Our RESP packer sends exactly the bytes redis-py's own packer sends.

The Valkey tier swaps redis-py's command packer for one that keeps the
object header and payload as separate buffers (:class:`Scatter`); any
difference on the wire would corrupt commands, so compare byte for byte.
"""

from __future__ import annotations

import pytest
from redis.connection import Encoder, PythonRespSerializer

from kvstrata.sidecar.tiers.valkey import Scatter, _ScatterPacker

CUTOFF = 6000
ENCODE = Encoder("utf-8", "strict", False).encode


def wire(chunks) -> bytes:
    return b"".join(bytes(c) for c in chunks)


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
    assert any(isinstance(c, memoryview) and c.obj is payload for c in chunks)
