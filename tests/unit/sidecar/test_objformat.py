"""The object format below L1: round trip and corruption detection per codec."""

from __future__ import annotations

import pytest

from kvstrata.sidecar.codecs import CODEC_IDS
from kvstrata.sidecar.objformat import (
    ChunkMeta,
    CorruptObjectError,
    decode,
    decode_header,
    encode,
    encode_bytes,
    payload_matches,
)

from ..conftest import make_key

KEY = make_key(1)
META = ChunkMeta("bfloat16", (2, 8, 64))
# Compressible (repeated) and incompressible-looking payloads.
PAYLOADS = {
    "repetitive": b"\x01\x3f" * 4096,
    "mixed": bytes((i * 7919) % 251 for i in range(8192)),
}
CODECS = sorted(CODEC_IDS)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("name", sorted(PAYLOADS))
def test_round_trip_for_every_codec(codec, name):
    payload = PAYLOADS[name]
    blob = encode_bytes(KEY, payload, META, codec)
    obj = decode(blob, expected_key=KEY)
    assert bytes(obj.payload) == payload
    assert obj.meta == META
    header = decode_header(blob, expected_key=KEY)
    assert header.raw_length == len(payload)
    assert payload_matches(header, memoryview(blob)[header.header_length :])


def test_uncompressed_payload_is_not_copied():
    payload = bytearray(b"abc" * 100)
    _header, stored = encode(KEY, payload, META)
    assert isinstance(stored, memoryview) and stored.obj is payload


@pytest.mark.parametrize("codec", CODECS)
def test_every_flipped_byte_is_detected(codec):
    blob = bytearray(encode_bytes(KEY, PAYLOADS["repetitive"], META, codec))
    step = max(1, len(blob) // 200)
    for at in sorted(set(range(min(160, len(blob)))) | set(range(0, len(blob), step))):
        damaged = bytearray(blob)
        damaged[at] ^= 0x01
        with pytest.raises(CorruptObjectError):
            decode(damaged, expected_key=KEY)


@pytest.mark.parametrize("codec", CODECS)
def test_truncated_and_extended_objects_are_refused(codec):
    blob = encode_bytes(KEY, PAYLOADS["mixed"], META, codec)
    for cut in (0, 10, 56, 100, len(blob) - 1):
        with pytest.raises(CorruptObjectError):
            decode(blob[:cut], expected_key=KEY)
    with pytest.raises(CorruptObjectError):
        decode(blob + b"\0", expected_key=KEY)


def test_an_object_for_another_key_is_refused():
    blob = encode_bytes(KEY, b"x" * 10, META)
    with pytest.raises(CorruptObjectError, match="different key"):
        decode(blob, expected_key=make_key(2))
    with pytest.raises(CorruptObjectError, match="different key"):
        decode_header(blob, expected_key=make_key(2))


def test_bad_metadata_is_refused_at_encode():
    with pytest.raises(ValueError, match="dims"):
        encode(KEY, b"", ChunkMeta("uint8", (1,) * 9))
    with pytest.raises(ValueError, match="dtype"):
        encode(KEY, b"", ChunkMeta("x" * 17, ()))
    with pytest.raises(ValueError, match="unknown codec"):
        encode(KEY, b"abc", META, codec="brotli")
