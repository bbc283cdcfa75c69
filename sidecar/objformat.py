"""The format of every chunk object stored below L1 (disk files, Valkey
values, S3 objects).

Layout (little endian)::

    offset size  field
    0      4     magic            b"KVS1"
    4      2     format version   2 (checksum in the header) or 3 (in a trailer)
    6      1     codec id         0 none, 1 zstd, 2 lz4 (see codecs.py)
    7      1     ndim             0..8
    8      16    dtype            ASCII, NUL padded ("bfloat16", "uint8", ...)
    24     8     raw length       payload bytes before the codec
    32     8     stored length    payload bytes as stored (after the codec)
    40     8     checksum         xxh3_64 of the stored payload (version 3: 0)
    48     8     header checksum  xxh3_64 of bytes 0..48 + shape + key
    56     8*nd  shape            uint64 each
    ..     2     blocks           uint16: 0 for a full chunk, else the block
                                  count of a partial chunk (a prompt's tail)
    ..     1+k   key              length byte, then the chunk key
    ..     n     payload          stored length bytes
    ..     8     trailer          version 3 only: xxh3_64 of the stored payload

Two versions, one header. Version 2 (disk files) carries the payload
checksum in the header, so the whole payload is hashed before the first
byte is written. Version 3 (Valkey values, S3 objects) carries it in a
trailer after the payload: :class:`StreamedObject` hashes each piece of
the payload just before that piece goes out (while the server is still
taking the previous piece), instead of one pass over the whole payload
before the upload starts. Readers accept both versions,
so objects written before version 3 keep being read; a reader that knows
only version 2 refuses a version-3 object as corrupt (a miss, never a
wrong read). The version field is covered by the header checksum, so a
flipped version is refused too.

The key is repeated inside the object so that a file or value that ends up
under the wrong name is refused. The block count travels with the object so
that a partial chunk is never taken for a full one: a reader that expects a
full chunk refuses any other count (:mod:`kvstrata.sidecar.partials`).
Any mismatch (magic, version, lengths, either checksum, key) raises
:class:`CorruptObjectError`; callers count it and treat it as a miss: a bad
object is never returned as KV.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass

import xxhash

from kvstrata.sidecar.codecs import CODEC_IDS, CODEC_NAMES, CodecError, compress, decompress

MAGIC = b"KVS1"
FORMAT_VERSION = 2  # payload checksum in the header
TRAILER_FORMAT_VERSION = 3  # payload checksum in a trailer after the payload
TRAILER_BYTES = 8
# The payload goes out (and is hashed) in pieces this large. Each piece is
# one more send call, which on a full socket buffer waits for the server, so
# pieces must not be small. Measured on the 2-core build VM against a loopback
# redis-server (client process CPU per byte, 16 / 32 MiB values): SET of the
# plain bytes 0.153 / 0.181 ns, hash then send in one piece 0.193 / 0.211 ns,
# 8 MiB pieces 0.200 / 0.221 ns, 4 MiB pieces 0.233 / 0.246 ns, 1 MiB pieces
# 0.332 ns (16 MiB). So values up to 8 MiB go in one piece, and larger ones
# hash each 8 MiB while the server is still taking the previous one.
PIECE_BYTES = 8 * 1024 * 1024
MAX_NDIM = 8
_FIXED = struct.Struct("<4sHBB16sQQQQ")
FIXED_HEADER_BYTES = _FIXED.size  # 56


class CorruptObjectError(ValueError):
    """The object failed validation; treat as a miss and count it."""


@dataclass(frozen=True, slots=True)
class ChunkMeta:
    """What a chunk's bytes are: element type and shape of the KV they hold."""

    dtype: str = "uint8"
    shape: tuple[int, ...] = ()
    blocks: int = 0  # 0: a full chunk; else the blocks of a partial chunk
    # The tenant that stored it ("": the default tenant; kvstrata.sidecar.tenants).
    # Process memory only: not in the header, so a chunk read back from a
    # tier below L1 is the default tenant's.
    tenant: str = ""


@dataclass(frozen=True, slots=True)
class DecodedObject:
    meta: ChunkMeta
    payload: bytes | memoryview


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
) -> bytes:
    tail = struct.pack(f"<{len(meta.shape)}QH", *meta.shape, meta.blocks) + bytes([len(key)]) + key
    fixed_wo_hc = _FIXED.pack(
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


def encode(
    key: bytes, payload: bytes | memoryview, meta: ChunkMeta, codec: str = "none"
) -> list[bytes | memoryview]:
    """Header and (possibly compressed) payload as buffers to write in order
    (version 2: checksum in the header).

    Returned as two pieces so uncompressed payloads are never copied.
    """
    check_meta(key, meta)
    raw, stored, codec = _stored_payload(payload, codec)
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

    __slots__ = ("_hash", "_hashed", "_trailer", "header", "stored")

    def __init__(self, header: bytes, stored: bytes | memoryview) -> None:
        self.header = header
        self.stored = memoryview(stored).cast("B")
        self._hash = xxhash.xxh3_64()
        self._hashed = 0
        self._trailer: bytes | None = None

    def __len__(self) -> int:
        return len(self.header) + len(self.stored) + TRAILER_BYTES

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


def encode_streamed(
    key: bytes, payload: bytes | memoryview, meta: ChunkMeta, codec: str = "none"
) -> StreamedObject:
    """A version-3 object (checksum in a trailer) ready to be sent piece by piece.

    Compression (when ``codec`` is set) runs here, in full; only the
    checksum is deferred to the sending.
    """
    check_meta(key, meta)
    raw, stored, codec = _stored_payload(payload, codec)
    header = _header(key, meta, codec, len(raw), len(stored), 0, TRAILER_FORMAT_VERSION)
    return StreamedObject(header, stored)


def check_meta(key: bytes, meta: ChunkMeta) -> None:
    """Raise ``ValueError`` for what :func:`encode` cannot write (cheap: no payload read)."""
    if len(meta.shape) > MAX_NDIM:
        raise ValueError(f"shape has {len(meta.shape)} dims; at most {MAX_NDIM}")
    if len(key) > 255:
        raise ValueError("key longer than 255 bytes")
    if len(meta.dtype.encode("ascii")) > 16:
        raise ValueError(f"dtype name {meta.dtype!r} longer than 16 bytes")
    if not 0 <= meta.blocks <= 0xFFFF:
        raise ValueError(f"block count {meta.blocks} out of range")


def encode_bytes(
    key: bytes, payload: bytes | memoryview, meta: ChunkMeta, codec: str = "none"
) -> bytes:
    """:func:`encode` joined into one bytes object (for stores that need one)."""
    return b"".join(encode(key, payload, meta, codec))


def header_length(blob_prefix: bytes | memoryview) -> int:
    """Total header length, given at least the first 56 bytes of an object."""
    if len(blob_prefix) < FIXED_HEADER_BYTES:
        raise CorruptObjectError("object shorter than its fixed header")
    ndim = blob_prefix[7]
    key_len_at = FIXED_HEADER_BYTES + 8 * ndim + 2
    if len(blob_prefix) <= key_len_at:
        return key_len_at + 1  # caller must read more to learn the key length
    return key_len_at + 1 + blob_prefix[key_len_at]


@dataclass(frozen=True, slots=True)
class ObjectHeader:
    """A validated header; the payload is checked separately (:func:`payload_matches`)."""

    meta: ChunkMeta
    codec: str
    raw_length: int
    stored_length: int
    checksum: int  # version 2; 0 in a version-3 header (the trailer holds it)
    key: bytes
    header_length: int
    trailer: bool = False  # version 3: an 8-byte checksum follows the payload


def decode_header(prefix: bytes | memoryview, expected_key: bytes | None = None) -> ObjectHeader:
    """Validate the header at the start of ``prefix`` (which may hold more bytes).

    For readers that place the payload themselves (the disk tier reads it
    straight into the L1 arena). Raises :class:`CorruptObjectError`.
    """
    view = memoryview(prefix).cast("B")
    if len(view) < FIXED_HEADER_BYTES:
        raise CorruptObjectError(f"object of {len(view)} bytes is shorter than a header")
    magic, version, codec_id, ndim, dtype_raw, raw_len, stored_len, checksum, header_checksum = (
        _FIXED.unpack_from(view, 0)
    )
    if magic != MAGIC:
        raise CorruptObjectError(f"bad magic {bytes(magic)!r}")
    if version not in (FORMAT_VERSION, TRAILER_FORMAT_VERSION):
        raise CorruptObjectError(f"unsupported format version {version}")
    if ndim > MAX_NDIM or codec_id not in CODEC_NAMES:
        raise CorruptObjectError("bad ndim or codec id")
    shape_end = FIXED_HEADER_BYTES + 8 * ndim + 2  # shape, then the block count
    if len(view) < shape_end + 1:
        raise CorruptObjectError("object truncated inside its header")
    header_end = shape_end + 1 + view[shape_end]
    if len(view) < header_end:
        raise CorruptObjectError("object truncated inside its key")
    tail = bytes(view[FIXED_HEADER_BYTES:header_end])
    if xxhash.xxh3_64_intdigest(bytes(view[:48]) + tail) != header_checksum:
        raise CorruptObjectError("header checksum mismatch")
    key = tail[8 * ndim + 3 :]
    if expected_key is not None and key != expected_key:
        raise CorruptObjectError("object holds a different key")
    *shape, blocks = struct.unpack_from(f"<{ndim}QH", view, FIXED_HEADER_BYTES)
    meta = ChunkMeta(
        dtype=dtype_raw.rstrip(b"\0").decode("ascii"), shape=tuple(shape), blocks=blocks
    )
    return ObjectHeader(
        meta,
        CODEC_NAMES[codec_id],
        raw_len,
        stored_len,
        checksum,
        key,
        header_end,
        trailer=version == TRAILER_FORMAT_VERSION,
    )


def decode(
    blob: bytes | memoryview, expected_key: bytes | None = None, payload_xxh3: int | None = None
) -> DecodedObject:
    """Validate and decode one whole object; raise :class:`CorruptObjectError`.

    ``payload_xxh3``: the stored payload's xxh3_64, when the reader already
    computed it while the bytes arrived (:class:`PayloadHasher`); it is then
    checked against the recorded checksum instead of hashing the payload again.
    """
    view = memoryview(blob).cast("B")
    header = decode_header(view, expected_key)
    checksum, end = header.checksum, len(view)
    if header.trailer:
        end -= TRAILER_BYTES
        if end < header.header_length:
            raise CorruptObjectError("object truncated inside its trailer")
        (checksum,) = struct.unpack_from("<Q", view, end)
    stored = view[header.header_length : end]
    if len(stored) != header.stored_length:
        raise CorruptObjectError(f"payload length {len(stored)} != recorded {header.stored_length}")
    if payload_xxh3 is None:
        payload_xxh3 = xxhash.xxh3_64_intdigest(stored)
    if payload_xxh3 != checksum:
        raise CorruptObjectError("payload checksum mismatch")
    try:
        payload = decompress(header.codec, stored, header.raw_length)
    except CodecError as exc:
        raise CorruptObjectError(str(exc)) from None
    if len(payload) != header.raw_length:
        raise CorruptObjectError(f"decoded length {len(payload)} != recorded {header.raw_length}")
    return DecodedObject(meta=header.meta, payload=payload)


class PayloadHasher:
    """Hashes an object's stored payload while the object is still being received.

    A reader that fills one buffer in order calls :meth:`received` with the
    bytes it has so far; once the header is in, the payload's bytes are hashed
    as they arrive, so the checksum costs no pass of its own after the last
    byte. :meth:`digest` is the payload's xxh3_64 for :func:`decode`, or None
    when the header never parsed (:func:`decode` then hashes and reports).
    """

    __slots__ = ("_end", "_hash", "_hashed", "_header_probe", "_size", "_start", "_view")

    # Enough for any header this format writes (48 fixed bytes, up to
    # MAX_NDIM shape words, the block count and a key of at most 255 bytes).
    HEADER_BYTES_MAX = FIXED_HEADER_BYTES + 8 * MAX_NDIM + 3 + 255

    def __init__(self, buffer: memoryview) -> None:
        self._view = buffer
        self._size = len(buffer)
        self._hash = xxhash.xxh3_64()
        self._start: int | None = None  # payload offsets, once the header is in
        self._end = 0
        self._hashed = 0
        self._header_probe = min(self._size, self.HEADER_BYTES_MAX)

    def received(self, filled: int) -> None:
        """The first ``filled`` bytes of the buffer are in: hash what they complete."""
        if self._start is None:
            if filled < self._header_probe:
                return
            try:
                header = decode_header(self._view[:filled])
            except CorruptObjectError:
                self._header_probe = self._size + 1  # never again; decode() reports it
                return
            self._start = self._hashed = header.header_length
            self._end = self._size - (TRAILER_BYTES if header.trailer else 0)
        upto = min(filled, self._end)
        if upto > self._hashed:
            self._hash.update(self._view[self._hashed : upto])
            self._hashed = upto

    def digest(self) -> int | None:
        """The payload's xxh3_64 once all of it was hashed, else None."""
        if self._start is None or self._hashed < self._end:
            return None
        return self._hash.intdigest()


def payload_matches(header: ObjectHeader, stored: bytes | memoryview) -> bool:
    """Whether ``stored`` is the payload a version-2 ``header`` describes (length
    and checksum). Always False for a version-3 header: its checksum is in the
    trailer, which this reader of header-and-payload objects does not have."""
    return (
        not header.trailer
        and len(stored) == header.stored_length
        and (xxhash.xxh3_64_intdigest(stored) == header.checksum)
    )
