"""Sealing and opening piece by piece (:class:`StreamCipher`): the same
bytes as a whole-object AES-GCM seal however the pieces fall, into the
segment buffer of an L2 write and out of the one of an L2 read, and a
sealed object sent to the shared tier sealed as it goes.

The expected bytes come from ``cryptography``'s one-shot ``AESGCM``, not
from the code under test."""

from __future__ import annotations

import errno
import itertools
import os
import random
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvstrata.sidecar import objformat
from kvstrata.sidecar.objformat import (
    FIRST_SEALED_PIECE_BYTES,
    SEALED_PIECE_BYTES,
    TAG_BYTES,
    ChunkMeta,
    SealError,
    decode,
    decode_header,
)
from kvstrata.sidecar.sealing import KeyRing
from kvstrata.sidecar.tiers import direct_io
from kvstrata.sidecar.tiers.disk import DiskTier
from kvstrata.testing.keyfolder import MountedSecret, key_files

from ..conftest import make_key, payload_for

KEY_MATERIAL = bytes(range(32))
NONCE = bytes(12)
AAD = b"the header"
SEG = direct_io.SEGMENT_BYTES


@pytest.fixture
def ring(tmp_path: Path) -> KeyRing:
    MountedSecret(tmp_path / "keys").publish(key_files({"k1": KEY_MATERIAL}, writing="k1"))
    return KeyRing("on", str(tmp_path / "keys"))


def _splits(total: int, seed: int) -> list[int]:
    """Piece lengths summing to ``total``: tiny, odd and block-straddling ones."""
    rng = random.Random(seed)
    out, left = [], total
    while left:
        n = min(left, rng.choice([1, 7, 15, 16, 17, 31, 4096, 65_537]))
        out.append(n)
        left -= n
    return out


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("slack", [0, 15, 64])
def test_sealing_piece_by_piece_gives_the_one_shot_ciphertext_and_tag(ring, seed, slack) -> None:
    data = os.urandom(200_003)
    expected = AESGCM(KEY_MATERIAL).encrypt(NONCE, data, AAD)
    stream = ring.sealing_stream("k1", "", NONCE, AAD)
    out = bytearray(len(data) + slack)
    at = 0
    for n in _splits(len(data), seed):
        # ``slack`` bytes of room past the piece: none, just under what
        # update_into wants, and plenty.
        stream.apply_into(memoryview(data)[at : at + n], memoryview(out)[at : at + n + slack])
        at += n
    assert bytes(out[: len(data)]) + stream.tag() == expected


@pytest.mark.parametrize("seed", range(3))
def test_opening_piece_by_piece_gives_the_plaintext_and_checks_the_tag(ring, seed) -> None:
    data = os.urandom(70_001)
    sealed = AESGCM(KEY_MATERIAL).encrypt(NONCE, data, AAD)
    for tamper in (None, 5, len(data) + 3):  # intact, a ciphertext byte, a tag byte
        blob = bytearray(sealed)
        if tamper is not None:
            blob[tamper] ^= 0x40
        stream = ring.opening_stream("k1", "", NONCE, AAD)
        out = bytearray(len(data))
        at = 0
        for n in _splits(len(data), seed):
            stream.apply_into(memoryview(blob)[at : at + n], memoryview(out)[at:])
            at += n
        if tamper is None:
            stream.verify(blob[len(data) :])
            assert bytes(out) == data
        else:
            with pytest.raises(SealError) as failed:
                stream.verify(blob[len(data) :])
            assert failed.value.reason == "auth_failed"


def test_a_payload_is_opened_over_itself_piece_by_piece(ring) -> None:
    """What a sealed object received into its L1 slot relies on
    (tiers/placing.py OpenedInPlace): the cipher reads and writes the same bytes."""
    data = os.urandom(300_017)
    sealed = AESGCM(KEY_MATERIAL).encrypt(NONCE, data, AAD)
    slot = memoryview(bytearray(sealed[: len(data)]))
    stream = ring.opening_stream("k1", "", NONCE, AAD)
    at = 0
    for n in _splits(len(data), 9):
        stream.apply_into(slot[at : at + n], slot[at:])
        at += n
    stream.verify(sealed[len(data) :])
    assert bytes(slot) == data


def test_a_stream_under_a_key_the_ring_lacks_is_refused_by_reason(ring) -> None:
    with pytest.raises(SealError) as failed:
        ring.opening_stream("k9", "", NONCE, AAD)
    assert failed.value.reason == "unknown_key"
    with pytest.raises(SealError) as failed:
        ring.sealing_stream("k9", "", NONCE, AAD)
    assert failed.value.reason == "unknown_key"


@pytest.mark.parametrize("seed", range(3))
def test_a_sealing_payload_written_in_any_pieces_and_again_after_a_rewind(ring, seed) -> None:
    key, data = make_key(1), os.urandom(50_000)
    header, payload = objformat.encode_for_file(key, data, ChunkMeta("uint8", (50_000,)), ring)
    assert isinstance(payload, objformat.SealingPayload) and len(payload) == len(data) + TAG_BYTES
    written = []
    for attempt in range(2):  # the second after a rewind: a refused write written again
        out = bytearray(len(payload) + 64)
        at = 0
        for n in _splits(len(payload), seed + attempt):
            payload.produce_into(memoryview(out)[at:], n)
            at += n
        written.append(bytes(out[: len(payload)]))
        payload.rewind()
    assert written[0] == written[1]
    seal = decode_header(header).seal
    aead = AESGCM(ring._cipher(seal.key_id, seal.label)[1])
    assert written[0] == aead.encrypt(seal.nonce, data, header)
    assert bytes(decode(header + written[0], key, keys=ring).payload) == data


def test_a_sealed_streamed_object_is_sealed_piece_by_piece_as_it_is_sent(ring) -> None:
    key, data = make_key(2), os.urandom(2 * SEALED_PIECE_BYTES + 12_345)
    obj = objformat.encode_streamed(key, data, ChunkMeta("uint8", (len(data),)), keys=ring)
    pieces = obj.pieces()
    header = bytes(next(pieces))
    drawn: list[bytes] = []
    for piece in pieces:
        drawn.append(bytes(piece))
        # Each piece is sealed when it is handed out, no further: the next is
        # sealed while this one is on its way.
        assert obj._ready == min(sum(map(len, drawn)), len(data))
    payload_pieces, trailer = drawn[:-1], drawn[-1]
    # The first piece is small (the server starts after one small piece's
    # sealing), each next one twice the last up to the largest.
    sizes = [len(p) for p in payload_pieces]
    assert sizes[0] == FIRST_SEALED_PIECE_BYTES < SEALED_PIECE_BYTES
    for before, after in itertools.pairwise(sizes[:-1]):
        assert after == min(2 * before, SEALED_PIECE_BYTES)
    assert sizes.count(SEALED_PIECE_BYTES) >= 1 and sum(sizes) == len(data)
    blob = header + b"".join(payload_pieces) + trailer
    assert len(blob) == len(obj) and len(trailer) == TAG_BYTES
    assert bytes(decode(blob, key, keys=ring).payload) == data
    # A retry (or a reader that rewinds) gets the same bytes; nothing is sealed twice.
    assert b"".join(bytes(p) for p in obj.pieces()) == blob
    at, again = 0, b""
    while chunk := obj.read_at(at, 1 << 20):
        again += bytes(chunk)
        at += len(chunk)
    assert again == blob
    obj.release()
    assert ring.buffers.free_bytes >= len(data)  # its ciphertext buffer is back for reuse


def _sealed_size_ending_at(ring: KeyRing, file_end: int) -> int:
    """A payload size whose sealed file ends ``file_end`` bytes into the file."""
    header, _ = objformat.encode_for_file(make_key(0), b"\0", ChunkMeta("uint8", (1,)), ring)
    return file_end - len(header) - TAG_BYTES


@pytest.mark.parametrize(
    "end", [SEG - 8, SEG, SEG + 8, 2 * SEG + 4096 + 1, 5000], ids=lambda e: f"file-{e}"
)
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_an_l2_file_sealed_into_its_segments_and_opened_out_of_them(
    tmp_path, ring, end, direct
) -> None:
    """Files whose tag ends just before, at, and just past a segment's end
    (the tag split across two reads), and a small one."""
    if direct and not direct_io.supported(str(tmp_path)):
        pytest.skip(f"the filesystem under {tmp_path} has no O_DIRECT")
    size = _sealed_size_ending_at(ring, end)
    tier = DiskTier(tmp_path / "l2", 64 << 20, direct=direct, keys=ring)
    key = make_key(size)
    data = payload_for(key, size)
    meta = ChunkMeta("uint8", (size,))
    assert tier.put(key, data, meta)
    with open(tier.path_of(key), "rb") as fh:
        on_disk = fh.read()
    assert len(on_disk) == end
    assert bytes(decode(on_disk, key, keys=ring).payload) == data  # the whole-object reader
    out = bytearray(size + 100)
    assert tier.read_into(key, memoryview(out)) == meta
    assert bytes(out[:size]) == data
    assert tier.stats().decrypt_failures_total == {}
    assert (ring.buffers.reused_total, ring.buffers.free_bytes) == (0, 0)  # no ciphertext buffer


@pytest.mark.parametrize("where", ["ciphertext", "tag"])
def test_a_tampered_l2_file_read_into_a_slot_is_a_counted_miss_and_removed(
    tmp_path, ring, where
) -> None:
    size = _sealed_size_ending_at(ring, SEG + 8)  # the tag straddles two segments
    tier = DiskTier(tmp_path / "l2", 64 << 20, keys=ring)
    key = make_key(7)
    assert tier.put(key, payload_for(key, size), ChunkMeta("uint8", (size,)))
    path = tier.path_of(key)
    blob = bytearray(Path(path).read_bytes())
    blob[1000 if where == "ciphertext" else len(blob) - 10] ^= 0x01
    Path(path).write_bytes(bytes(blob))
    assert tier.read_into(key, memoryview(bytearray(size))) is None
    assert tier.stats().decrypt_failures_total == {"auth_failed": 1}
    assert not os.path.exists(path) and not tier.contains(key)


def test_a_sealed_write_refused_after_the_open_is_sealed_again_through_the_page_cache(
    tmp_path, ring, monkeypatch
) -> None:
    """A filesystem that takes O_DIRECT at open and refuses the write after
    part of the payload was sealed (a fault stand-in, named so: none at hand does)."""
    if not direct_io.supported(str(tmp_path)):
        pytest.skip(f"the filesystem under {tmp_path} has no O_DIRECT")
    real = direct_io.write_object

    def refusing_after_one_segment(fd: int, pieces: list) -> int:  # fault stand-in
        segments = direct_io._segments(pieces)
        next(segments)  # one segment sealed, then the refusal
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(direct_io, "write_object", refusing_after_one_segment)
    tier = DiskTier(tmp_path / "l2", 64 << 20, keys=ring)
    size = 3 * SEG
    key = make_key(8)
    assert tier.put(key, payload_for(key, size), ChunkMeta("uint8", (size,)))
    assert not tier.direct_io
    monkeypatch.setattr(direct_io, "write_object", real)
    out = bytearray(size)
    assert tier.read_into(key, memoryview(out)) == ChunkMeta("uint8", (size,))
    assert bytes(out) == payload_for(key, size)
    assert tier.stats().decrypt_failures_total == {} and tier.stats().errors_total == {}
