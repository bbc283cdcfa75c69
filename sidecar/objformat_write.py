"""Writing chunk objects: the encoders of every version and the streamed object.

Why a module of its own: a writer builds the header, compresses, seals
(AES-GCM) or hashes the payload, and hands out buffers to write in order;
the readers (:mod:`.objformat`) validate what comes back. Which writer
each tier uses: :func:`encode` (version 2, checksum in the header) and
:func:`encode_for_file` for disk files (a sealed payload sealed into the
write's own buffer, :class:`SealingPayload`), :func:`encode_streamed`
(version 3, checksum in a trailer, hashed as it is sent) for Valkey values
and S3 objects; each writes version 4 (sealed, as the bytes go out) when
given a writing key. The
format is described in :mod:`kvstrata.sidecar.objformat`, which
re-exports every name here.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import xxhash

from kvstrata.sidecar.codecs import CODEC_IDS, compress
from kvstrata.sidecar.objformat_fields import (
    FIXED,
    FORMAT_VERSION,
    MAGIC,
    SEALED_FORMAT_VERSION,
    TAG_BYTES,
    TRAILER_FORMAT_VERSION,
    ChunkMeta,
    Seal,
    check_meta,
)

if TYPE_CHECKING:
    from kvstrata.sidecar.sealing import KeyRing, StreamCipher

__all__ = [
    "FIRST_SEALED_PIECE_BYTES",
    "PIECE_BYTES",
    "SEALED_PIECE_BYTES",
    "SealingPayload",
    "StreamedObject",
    "encode",
    "encode_bytes",
    "encode_for_file",
    "encode_streamed",
]

# The payload goes out (and is hashed) in pieces this large. Each piece is
# one more send call, which on a full socket buffer waits for the server, so
# pieces must not be small. Measured on the 2-core build VM against a loopback
# redis-server (client process CPU per byte, 16 / 32 MiB values): SET of the
# plain bytes 0.153 / 0.181 ns, hash then send in one piece 0.193 / 0.211 ns,
# 8 MiB pieces 0.200 / 0.221 ns, 4 MiB pieces 0.233 / 0.246 ns, 1 MiB pieces
# 0.332 ns (16 MiB). So values up to 8 MiB go in one piece, and larger ones
# hash each 8 MiB while the server is still taking the previous one.
PIECE_BYTES = 8 * 1024 * 1024


def _stored_payload(
    payload: bytes | memoryview, codec: str
) -> tuple[memoryview, bytes | memoryview, str]:
    """The raw payload as bytes, what is stored for it, and the codec actually used."""
    raw = memoryview(payload).cast("B")
    stored = compress(codec, raw)
    if codec != "none" and len(stored) >= len(raw):
        codec, stored = "none", raw  # incompressible: store raw, skip decode cost
    return raw, stored, codec


def _header(
    key: bytes,
    meta: ChunkMeta,
    codec: str,
    raw_length: int,
    stored_length: int,
    checksum: int,
    version: int,
    seal: Seal | None = None,
) -> bytes:
    tail = struct.pack(f"<{len(meta.shape)}QH", *meta.shape, meta.blocks) + bytes([len(key)]) + key
    if seal is not None:
        tail += seal.pack()
    fixed_wo_hc = FIXED.pack(
        MAGIC,
        version,
        CODEC_IDS[codec],
        len(meta.shape),
        meta.dtype.encode("ascii"),
        raw_length,
        stored_length,
        checksum,
        0,
    )[:48]
    header_checksum = xxhash.xxh3_64_intdigest(fixed_wo_hc + tail)
    return fixed_wo_hc + struct.pack("<Q", header_checksum) + tail


def _seal_header(
    key: bytes,
    raw: memoryview,
    stored: bytes | memoryview,
    meta: ChunkMeta,
    codec: str,
    keys: KeyRing | None,
    tenant: str | None,
) -> tuple[bytes, Seal] | None:
    """(version-4 header, its seal), or None when ``keys`` has no key to seal
    with (the object is written in plaintext)."""
    # A tenant's chunks are sealed under its derived key (the chunk's own
    # tenant unless the caller names one): a tenant's key can be dropped alone.
    label = tenant if tenant is not None else (meta.tenant or None)
    params = keys.seal_params(label) if keys is not None else None
    if params is None:
        return None
    seal = Seal(*params)
    header = _header(key, meta, codec, len(raw), len(stored), 0, SEALED_FORMAT_VERSION, seal)
    return header, seal


def _sealed(
    key: bytes,
    raw: memoryview,
    stored: bytes | memoryview,
    meta: ChunkMeta,
    codec: str,
    keys: KeyRing | None,
    tenant: str | None,
) -> tuple[bytes, bytes] | None:
    """(version-4 header, ciphertext then tag), or None when ``keys`` has no
    key to seal with (the object is written in plaintext)."""
    sealing = _seal_header(key, raw, stored, meta, codec, keys, tenant)
    if sealing is None or keys is None:
        return None
    header, seal = sealing
    return header, keys.encrypt(seal.key_id, seal.label, seal.nonce, stored, header)


def encode(
    key: bytes,
    payload: bytes | memoryview,
    meta: ChunkMeta,
    codec: str = "none",
    keys: KeyRing | None = None,
    tenant: str | None = None,
) -> list[bytes | memoryview]:
    """Header and (possibly compressed) payload as buffers to write in order
    (version 2: checksum in the header; version 4, sealed, when ``keys``
    has a writing key: ciphertext then tag).

    Returned as two pieces so uncompressed payloads are never copied.
    """
    check_meta(key, meta)
    raw, stored, codec = _stored_payload(payload, codec)
    sealed = _sealed(key, raw, stored, meta, codec, keys, tenant)
    if sealed is not None:
        return list(sealed)
    checksum = xxhash.xxh3_64_intdigest(stored)
    header = _header(key, meta, codec, len(raw), len(stored), checksum, FORMAT_VERSION)
    return [header, stored]


# A sealed payload goes out in smaller pieces: each is sealed just before it
# is sent, so the next is sealed while the socket (and the server) still
# take the last one. The first piece is small and each next one twice the
# last, up to SEALED_PIECE_BYTES: the server starts on an object after one
# small piece's sealing, where a whole first piece kept it waiting for the
# cipher, and a large object still goes in few sends (each costs a system
# call and, on a full socket buffer, a wait). Measured on the 2-core build
# VM against a loopback redis-server (bench/remote.py's sealed rows, serial
# puts of 1 / 4 MiB chunks, sealed / plain): 2 MiB pieces from the start
# 0.82 / 0.80-0.86; from 64 KiB 0.99 / 0.88; from 128 KiB 0.85-1.02 /
# 0.93-0.96; from 256 KiB (up to 1 MiB) 0.97 / 0.99.
FIRST_SEALED_PIECE_BYTES = 128 * 1024
SEALED_PIECE_BYTES = 2 * 1024 * 1024


class SealingPayload:
    """A payload's ciphertext then its tag, sealed in order into whatever
    buffer the writer hands over (:class:`~kvstrata.sidecar.sealing.StreamCipher`).

    The L2 writer hands the aligned buffer its direct write goes from, so a
    sealed file costs the cipher's pass where a plaintext one costs a copy.
    """

    __slots__ = ("_at", "_make_stream", "_plain", "_stream", "_tag")

    def __init__(self, plain: memoryview, make_stream: Callable[[], StreamCipher]) -> None:
        self._plain = plain
        self._make_stream = make_stream
        self.rewind()

    def rewind(self) -> None:
        """Start again from the first byte (a write that failed part way is
        written again: the same key, nonce and bytes seal to the same ciphertext)."""
        self._stream = self._make_stream()
        self._at = 0
        self._tag: bytes | None = None

    def __len__(self) -> int:
        return len(self._plain) + TAG_BYTES

    def produce_into(self, out: memoryview, n: int) -> None:
        """The next ``n`` bytes into ``out[:n]``; ``out`` may be longer (the
        cipher is faster with room past the data: :meth:`StreamCipher.apply_into`)."""
        at, plain = self._at, self._plain
        k = max(min(n, len(plain) - at), 0)  # plaintext bytes among the n
        if k:
            self._stream.apply_into(plain[at : at + k], out)
        if k < n:  # the rest are the tag's
            if self._tag is None:
                self._tag = self._stream.tag()
            start = max(at - len(plain), 0)
            out[k:n] = self._tag[start : start + n - k]
        self._at = at + n


class StreamedObject:
    """One object made ready piece by piece as it is sent: a version-3 one
    whose payload checksum is computed as it goes, or a sealed (version-4)
    one whose payload is sealed as it goes.

    :meth:`pieces` hands out the header, the payload in pieces (each hashed,
    or sealed into the object's ciphertext buffer, just before it is handed
    out) and the trailer (the checksum, or the AES-GCM tag); :meth:`read_at`
    serves a file-like reader the same way. Sending again (a retry) never
    hashes or seals a byte twice: both only move forward.
    """

    __slots__ = ("_hash", "_ready", "_release", "_sealing", "_trailer", "header", "stored")

    def __init__(
        self,
        header: bytes,
        stored: bytes | memoryview,
        sealing: tuple[memoryview, StreamCipher] | None = None,
        release: Callable[[], None] | None = None,
    ) -> None:
        """``sealing``: (plaintext, its cipher); ``stored`` is then the buffer
        the ciphertext goes to (at least 15 bytes longer than the plaintext:
        room the cipher uses) and ``release`` gives it back (sealbuffers)."""
        self.header = header
        self._release = release
        self._hash = xxhash.xxh3_64()
        self._ready = 0  # payload bytes hashed (plaintext) or sealed so far
        self._trailer: bytes | None = None
        # Sealed: (plaintext, the whole ciphertext buffer, its cipher).
        self._sealing: tuple[memoryview, memoryview, StreamCipher] | None = None
        if sealing is None:
            self.stored = memoryview(stored).cast("B")
        else:
            plain, stream = sealing
            out = memoryview(stored).cast("B")
            self.stored = out[: len(plain)]
            self._sealing = (plain, out, stream)

    def __len__(self) -> int:
        return len(self.header) + len(self.stored) + (TAG_BYTES if self._sealing else 8)

    def _piece_ends(self, piece_bytes: int | None) -> Iterator[int]:
        """Where each payload piece :meth:`pieces` hands out ends: every
        ``piece_bytes``, or by default growing from
        :data:`FIRST_SEALED_PIECE_BYTES` to :data:`SEALED_PIECE_BYTES` for a
        sealed payload and every :data:`PIECE_BYTES` for a plaintext one."""
        if piece_bytes is not None:
            size = top = piece_bytes
        elif self._sealing is not None:
            size, top = FIRST_SEALED_PIECE_BYTES, SEALED_PIECE_BYTES
        else:
            size = top = PIECE_BYTES
        end = 0
        while end < len(self.stored):
            end = min(end + size, len(self.stored))
            yield end
            size = min(2 * size, top)

    def ready_through(self, end: int) -> None:
        """Hash (or seal) the payload up to offset ``end`` if not yet done."""
        start = self._ready
        if end <= start:
            return
        if self._sealing is not None:
            plain, out, stream = self._sealing
            stream.apply_into(plain[start:end], out[start:])
        else:
            self._hash.update(self.stored[start:end])
        self._ready = end

    def trailer(self) -> bytes:
        """The trailer: the checksum's 8 bytes, or a sealed object's 16-byte
        tag (either once the whole payload went through)."""
        if self._trailer is None:
            self.ready_through(len(self.stored))
            if self._sealing is not None:
                self._trailer = self._sealing[2].tag()
            else:
                self._trailer = struct.pack("<Q", self._hash.intdigest())
        return self._trailer

    def pieces(self, piece_bytes: int | None = None) -> Iterator[bytes | memoryview]:
        """The whole object in order, each payload piece hashed or sealed as it
        is yielded (pieces of ``piece_bytes``, by default as :meth:`_piece_ends` says)."""
        yield self.header
        start = 0
        for end in self._piece_ends(piece_bytes):
            self.ready_through(end)
            yield self.stored[start:end]
            start = end
        yield self.trailer()

    def release(self) -> None:
        """The sending is over (for good: no retry follows): a pooled buffer
        goes back for reuse. The object must not be read after this."""
        release, self._release = self._release, None
        if release is not None:
            self.stored = memoryview(b"")
            self._sealing = None
            release()

    def read_at(self, offset: int, size: int) -> bytes | memoryview:
        """Up to ``size`` bytes at ``offset`` of the object, from one of its three
        parts (fewer at a part boundary; empty at the end)."""
        header_end = len(self.header)
        if offset < header_end:
            return memoryview(self.header)[offset : min(header_end, offset + size)]
        at = offset - header_end
        if at < len(self.stored):
            end = min(len(self.stored), at + size)
            self.ready_through(end)
            return self.stored[at:end]
        at -= len(self.stored)
        return self.trailer()[at : at + size]


def _sealing_stream(
    key: bytes,
    raw: memoryview,
    stored: bytes | memoryview,
    meta: ChunkMeta,
    codec: str,
    keys: KeyRing | None,
    tenant: str | None,
) -> tuple[bytes, Callable[[], StreamCipher]] | None:
    """(version-4 header, what makes the cipher that seals its payload), or
    None when ``keys`` has no key to seal with (the object is written in
    plaintext). Making the cipher raises :class:`SealError` when the writing
    key was rotated out since: the caller makes the first at once."""
    sealing = _seal_header(key, raw, stored, meta, codec, keys, tenant)
    if sealing is None or keys is None:
        return None
    header, seal = sealing
    ring = keys

    def make_stream() -> StreamCipher:
        return ring.sealing_stream(seal.key_id, seal.label, seal.nonce, header)

    return header, make_stream


def encode_for_file(
    key: bytes,
    payload: bytes | memoryview,
    meta: ChunkMeta,
    keys: KeyRing | None = None,
) -> tuple[bytes, memoryview | SealingPayload]:
    """:func:`encode` (no codec) for the L2 writer: the header, and the
    payload as it is, or (sealed, when ``keys`` has a writing key) a
    :class:`SealingPayload` that seals it into the buffers the writer hands over."""
    check_meta(key, meta)
    raw, stored, codec = _stored_payload(payload, "none")
    sealing = _sealing_stream(key, raw, stored, meta, codec, keys, None)
    if sealing is not None:
        header, make_stream = sealing
        return header, SealingPayload(memoryview(stored).cast("B"), make_stream)
    checksum = xxhash.xxh3_64_intdigest(stored)
    return _header(key, meta, codec, len(raw), len(stored), checksum, FORMAT_VERSION), raw


def encode_streamed(
    key: bytes,
    payload: bytes | memoryview,
    meta: ChunkMeta,
    codec: str = "none",
    keys: KeyRing | None = None,
    tenant: str | None = None,
) -> StreamedObject:
    """A version-3 object (checksum in a trailer) ready to be sent piece by
    piece, or a version-4 (sealed) one when ``keys`` has a writing key.

    Compression (when ``codec`` is set) runs here, in full; a plaintext
    object's checksum and a sealed one's encryption run as it is sent, its
    ciphertext going to a reused buffer (:mod:`kvstrata.sidecar.sealbuffers`).
    """
    check_meta(key, meta)
    raw, stored, codec = _stored_payload(payload, codec)
    sealing = _sealing_stream(key, raw, stored, meta, codec, keys, tenant)
    if sealing is not None and keys is not None:
        header, make_stream = sealing
        stream = make_stream()
        buffers = keys.buffers
        buf = buffers.take(len(stored) + TAG_BYTES)
        plain = memoryview(stored).cast("B")
        return StreamedObject(header, buf, (plain, stream), lambda: buffers.give(buf))
    header = _header(key, meta, codec, len(raw), len(stored), 0, TRAILER_FORMAT_VERSION)
    return StreamedObject(header, stored)


def encode_bytes(
    key: bytes, payload: bytes | memoryview, meta: ChunkMeta, codec: str = "none"
) -> bytes:
    """:func:`encode` joined into one bytes object (for stores that need one)."""
    return b"".join(encode(key, payload, meta, codec))
