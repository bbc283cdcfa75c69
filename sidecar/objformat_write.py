"""Writing chunk objects: the encoders of every version and the streamed object.

Why a module of its own: a writer builds the header, compresses, seals
(AES-GCM) or hashes the payload, and hands out buffers to write in order;
the readers (:mod:`.objformat`) validate what comes back. Which writer
each tier uses: :func:`encode` (version 2, checksum in the header) and
:func:`encode_pooled` for disk files, :func:`encode_streamed` (version 3,
checksum in a trailer, hashed as it is sent) for Valkey values and S3
objects; each writes version 4 (sealed) when given a writing key. The
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
    from kvstrata.sidecar.sealing import KeyRing

__all__ = [
    "PIECE_BYTES",
    "StreamedObject",
    "encode",
    "encode_bytes",
    "encode_pooled",
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


class StreamedObject:
    """One version-3 object whose payload checksum is computed as it is sent.

    :meth:`pieces` hands out the header, the payload in :data:`PIECE_BYTES`
    pieces (each hashed just before it is handed out) and the trailer;
    :meth:`read_at` serves a file-like reader the same way. Sending again
    (a retry) never hashes a byte twice: the hash only moves forward.
    """

    __slots__ = ("_hash", "_hashed", "_release", "_trailer", "header", "stored")

    def __init__(
        self,
        header: bytes,
        stored: bytes | memoryview,
        tag: bytes | memoryview | None = None,
        release: Callable[[], None] | None = None,
    ) -> None:
        self.header = header
        self.stored = memoryview(stored).cast("B")
        # Gives a pooled ciphertext buffer back (sealbuffers); None: nothing to give.
        self._release = release
        self._hash = xxhash.xxh3_64()
        self._hashed = 0
        self._trailer: bytes | None = None
        if tag is not None:  # sealed: the AES-GCM tag is the trailer; nothing to hash
            self._trailer = bytes(tag)
            self._hashed = len(self.stored)

    def __len__(self) -> int:
        return len(self.header) + len(self.stored) + len(self.trailer())

    def hash_through(self, end: int) -> None:
        """Hash the payload up to offset ``end`` (of the payload) if not yet done."""
        if end > self._hashed:
            self._hash.update(self.stored[self._hashed : end])
            self._hashed = end

    def trailer(self) -> bytes:
        """The 8 trailer bytes (hashes whatever of the payload is not hashed yet)."""
        if self._trailer is None:
            self.hash_through(len(self.stored))
            self._trailer = struct.pack("<Q", self._hash.intdigest())
        return self._trailer

    def pieces(self, piece_bytes: int | None = None) -> Iterator[bytes | memoryview]:
        """The whole object in order, hashing each payload piece as it is yielded
        (pieces of ``piece_bytes``, by default :data:`PIECE_BYTES`)."""
        piece_bytes = piece_bytes or PIECE_BYTES
        yield self.header
        for start in range(0, len(self.stored), piece_bytes):
            end = min(start + piece_bytes, len(self.stored))
            self.hash_through(end)
            yield self.stored[start:end]
        yield self.trailer()

    def release(self) -> None:
        """The sending is over (for good: no retry follows): a pooled buffer
        goes back for reuse. The object must not be read after this."""
        release, self._release = self._release, None
        if release is not None:
            self.stored = memoryview(b"")
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
            self.hash_through(end)
            return self.stored[at:end]
        at -= len(self.stored)
        return self.trailer()[at : at + size]


def _sealed_pooled(
    key: bytes,
    raw: memoryview,
    stored: bytes | memoryview,
    meta: ChunkMeta,
    codec: str,
    keys: KeyRing | None,
    tenant: str | None,
) -> tuple[bytes, memoryview, Callable[[], None]] | None:
    """As :func:`_sealed`, the ciphertext (then tag) in a reused buffer
    (:mod:`kvstrata.sidecar.sealbuffers`) and the call that gives it back once
    the object is written; None when ``keys`` has no key to seal with."""
    sealing = _seal_header(key, raw, stored, meta, codec, keys, tenant)
    if sealing is None or keys is None:
        return None
    header, seal = sealing
    buf = keys.buffers.take(len(stored) + TAG_BYTES)
    view = memoryview(buf)[: len(stored) + TAG_BYTES]
    keys.encrypt_into(seal.key_id, seal.label, seal.nonce, stored, header, view)
    buffers = keys.buffers
    return header, view, lambda: buffers.give(buf)


def encode_pooled(
    key: bytes,
    payload: bytes | memoryview,
    meta: ChunkMeta,
    keys: KeyRing | None = None,
) -> tuple[list[bytes | memoryview], Callable[[], None] | None]:
    """:func:`encode` (no codec) for a writer that says when it is done: a
    sealed object's ciphertext is in a reused buffer, and the second item
    gives it back (call it once the pieces are written; None: nothing to give)."""
    check_meta(key, meta)
    raw, stored, codec = _stored_payload(payload, "none")
    pooled = _sealed_pooled(key, raw, stored, meta, codec, keys, None)
    if pooled is not None:
        header, view, release = pooled
        return [header, view], release
    checksum = xxhash.xxh3_64_intdigest(stored)
    header = _header(key, meta, codec, len(raw), len(stored), checksum, FORMAT_VERSION)
    return [header, stored], None


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

    Compression (when ``codec`` is set) and encryption run here, in full;
    only a plaintext object's checksum is deferred to the sending.
    """
    check_meta(key, meta)
    raw, stored, codec = _stored_payload(payload, codec)
    pooled = _sealed_pooled(key, raw, stored, meta, codec, keys, tenant)
    if pooled is not None:
        header, view, release = pooled
        return StreamedObject(header, view[:-TAG_BYTES], view[-TAG_BYTES:], release)
    header = _header(key, meta, codec, len(raw), len(stored), 0, TRAILER_FORMAT_VERSION)
    return StreamedObject(header, stored)


def encode_bytes(
    key: bytes, payload: bytes | memoryview, meta: ChunkMeta, codec: str = "none"
) -> bytes:
    """:func:`encode` joined into one bytes object (for stores that need one)."""
    return b"".join(encode(key, payload, meta, codec))
