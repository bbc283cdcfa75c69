"""The object format below L1: round trip and corruption detection per codec,
for both versions (2: checksum in the header; 3: checksum in a trailer)."""

from __future__ import annotations

import struct

import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from kvstrata.sidecar.codecs import CODEC_IDS
from kvstrata.sidecar.objformat import (
    ChunkMeta,
    CorruptObjectError,
    PayloadHasher,
    StreamedObject,
    decode,
    decode_header,
    encode,
    encode_bytes,
    encode_streamed,
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


# -- version 3: the checksum in a trailer, computed as the object is sent ---


def streamed_bytes(obj: StreamedObject, piece_bytes: int = 1000) -> bytes:
    return b"".join(bytes(p) for p in obj.pieces(piece_bytes))


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("name", sorted(PAYLOADS))
def test_streamed_object_round_trips_for_every_codec(codec, name):
    payload = PAYLOADS[name]
    obj = encode_streamed(KEY, payload, META, codec)
    blob = streamed_bytes(obj)
    assert len(blob) == len(obj)
    got = decode(blob, expected_key=KEY)
    assert bytes(got.payload) == payload and got.meta == META
    header = decode_header(blob, expected_key=KEY)
    assert header.trailer
    # The trailer is the xxh3_64 of the stored payload, little endian.
    stored = blob[header.header_length : -8]
    assert len(stored) == header.stored_length
    assert struct.unpack("<Q", blob[-8:])[0] == xxhash.xxh3_64_intdigest(stored)


def test_both_versions_of_one_chunk_decode_to_the_same_payload_and_meta():
    payload = PAYLOADS["mixed"]
    old = decode(encode_bytes(KEY, payload, META), expected_key=KEY)
    new = decode(streamed_bytes(encode_streamed(KEY, payload, META)), expected_key=KEY)
    assert bytes(old.payload) == bytes(new.payload) == payload
    assert old.meta == new.meta == META


@pytest.mark.parametrize("codec", CODECS)
def test_every_flipped_byte_of_a_streamed_object_is_detected(codec):
    blob = bytearray(streamed_bytes(encode_streamed(KEY, PAYLOADS["repetitive"], META, codec)))
    step = max(1, len(blob) // 200)
    tail = range(max(0, len(blob) - 16), len(blob))  # the payload's end and the trailer
    for at in sorted(set(range(min(160, len(blob)))) | set(range(0, len(blob), step)) | set(tail)):
        damaged = bytearray(blob)
        damaged[at] ^= 0x01
        with pytest.raises(CorruptObjectError):
            decode(damaged, expected_key=KEY)


@pytest.mark.parametrize("codec", CODECS)
def test_truncated_and_extended_streamed_objects_are_refused(codec):
    blob = streamed_bytes(encode_streamed(KEY, PAYLOADS["mixed"], META, codec))
    header_length = decode_header(blob).header_length
    for cut in (0, 10, 56, header_length + 3, len(blob) - 8, len(blob) - 1):
        with pytest.raises(CorruptObjectError):
            decode(blob[:cut], expected_key=KEY)
    with pytest.raises(CorruptObjectError):
        decode(blob + b"\0", expected_key=KEY)


def test_a_version_3_header_never_passes_the_header_only_payload_check():
    # The disk tier checks header + payload without a trailer: a version-3
    # object in its place must fail that check, not pass on a zero checksum.
    blob = streamed_bytes(encode_streamed(KEY, b"\0" * 64, META))
    header = decode_header(blob, expected_key=KEY)
    assert not payload_matches(header, blob[header.header_length : -8])


def test_each_payload_piece_is_hashed_when_it_is_sent_not_before():
    # The checksum must describe the bytes that went out: change the payload
    # after the object is encoded but before its pieces are drawn, and the
    # trailer still matches what was sent.
    payload = bytearray(b"a" * 5000)
    obj = encode_streamed(KEY, payload, META)
    pieces = obj.pieces(1000)
    sent = [bytes(next(pieces))]  # the header
    payload[:] = b"b" * 5000
    sent += [bytes(p) for p in pieces]
    got = decode(b"".join(sent), expected_key=KEY)
    assert bytes(got.payload) == b"b" * 5000


def test_uncompressed_streamed_payload_is_sent_from_the_callers_buffer():
    payload = bytearray(b"abc" * 1000)
    pieces = list(encode_streamed(KEY, payload, META).pieces(1000))
    assert all(isinstance(p, memoryview) and p.obj is payload for p in pieces[1:-1])


@pytest.mark.parametrize("size", [1, 7, 100, 4096, 1 << 20])
def test_read_at_serves_the_same_bytes_as_pieces_and_again_after_a_rewind(size):
    payload = PAYLOADS["mixed"]
    expected = streamed_bytes(encode_streamed(KEY, payload, META))
    obj = encode_streamed(KEY, payload, META)

    def read_all() -> bytes:
        out, at = bytearray(), 0
        while chunk := obj.read_at(at, size):
            assert len(chunk) <= size
            out += chunk
            at += len(chunk)
        return bytes(out)

    assert read_all() == expected
    assert read_all() == expected  # a retry re-reads from 0 and gets the same trailer


def test_pieces_drawn_again_send_the_same_object():
    # A connection retry packs and sends the same value again.
    obj = encode_streamed(KEY, PAYLOADS["mixed"], META)
    first = streamed_bytes(obj)
    assert streamed_bytes(obj, piece_bytes=333) == first
    assert bytes(decode(first, expected_key=KEY).payload) == PAYLOADS["mixed"]


def _v2(payload: bytes, codec: str) -> bytes:
    return encode_bytes(KEY, payload, META, codec)


def _v3(payload: bytes, codec: str) -> bytes:
    return b"".join(encode_streamed(KEY, payload, META, codec).pieces())


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("version", [_v2, _v3], ids=["v2", "v3"])
@given(cuts=st.lists(st.integers(min_value=0, max_value=20_000), max_size=12))
def test_payload_hashed_while_received_matches_the_recorded_checksum(codec, version, cuts):
    """However the bytes arrive (any receive sizes), the hasher's digest is
    the stored payload's xxh3, which decode accepts in place of hashing."""
    blob = version(PAYLOADS["mixed"], codec)
    buffer = memoryview(bytearray(len(blob)))
    hasher = PayloadHasher(buffer)
    for filled in [*sorted(min(c, len(blob)) for c in cuts), len(blob)]:
        buffer[:filled] = blob[:filled]
        hasher.received(filled)
    header = decode_header(blob)
    end = len(blob) - (8 if header.trailer else 0)
    assert hasher.digest() == xxhash.xxh3_64_intdigest(blob[header.header_length : end])
    assert bytes(decode(buffer, KEY, hasher.digest()).payload) == PAYLOADS["mixed"]


def test_a_digest_that_is_not_the_payloads_is_refused():
    blob = _v3(PAYLOADS["mixed"], "none")
    hasher = PayloadHasher(memoryview(blob))
    hasher.received(len(blob))
    with pytest.raises(CorruptObjectError, match="payload checksum"):
        decode(blob, KEY, hasher.digest() ^ 1)


def test_hasher_gives_no_digest_before_the_whole_payload_or_for_a_bad_header():
    blob = _v3(PAYLOADS["mixed"], "none")
    hasher = PayloadHasher(memoryview(blob))
    hasher.received(len(blob) - 9)  # the last payload byte is not in yet
    assert hasher.digest() is None
    broken = bytearray(blob)
    broken[0] ^= 0xFF  # bad magic: decode() must hash and report, not the hasher
    hasher = PayloadHasher(memoryview(broken))
    hasher.received(len(broken))
    assert hasher.digest() is None
    with pytest.raises(CorruptObjectError, match="magic"):
        decode(broken, KEY, hasher.digest())
