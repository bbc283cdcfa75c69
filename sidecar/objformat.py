"""The format of every chunk object stored below L1 (disk files, Valkey
values, S3 objects).

Layout (little endian)::

    offset size  field
    0      4     magic            b"KVS1"
    4      2     format version   2 (checksum in the header), 3 (in a trailer)
                                  or 4 (sealed: AES-GCM, see below)
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
    ..     seal                   version 4 only: key id (length byte, ASCII),
                                  tenant label (length byte, UTF-8; empty:
                                  none), 12-byte nonce
    ..     n     payload          stored length bytes (version 4: ciphertext)
    ..     8     trailer          version 3 only: xxh3_64 of the stored payload
    ..     16    tag              version 4 only: the AES-GCM tag

Version 4 is a sealed object (encryption at rest, :mod:`.sealing`): the
stored payload (after the codec) is encrypted with AES-256-GCM under the key
the seal names (per KVCache, or derived per tenant), with a fresh random
96-bit nonce per object. The associated data is the whole header, which
holds the chunk key (namespace fingerprint + block hash), the key id and the
tenant label: a ciphertext moved under another chunk key, namespace or key
id fails authentication. The tag replaces the payload checksum (the checksum
field is 0). A sealed object that cannot be opened (unknown key, failed tag,
no keys) or a plaintext object where encryption is ``required`` raises
:class:`SealError`, a :class:`CorruptObjectError` with a reason, counted
apart as a decrypt failure.

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

Where the parts live: the header's constants and typed values in
:mod:`.objformat_fields`, the writers in :mod:`.objformat_write`, the
readers here; every public name of the three is importable from here.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

import xxhash

from kvstrata.sidecar.codecs import CODEC_NAMES, CodecError, decompress
from kvstrata.sidecar.objformat_fields import (
    FIXED,
    FIXED_HEADER_BYTES,
    FORMAT_VERSION,
    MAGIC,
    MAX_NDIM,
    NONCE_BYTES,
    SEALED_FORMAT_VERSION,
    TAG_BYTES,
    TRAILER_BYTES,
    TRAILER_FORMAT_VERSION,
    ChunkMeta,
    CorruptObjectError,
    DecodedObject,
    Seal,
    SealError,
    check_meta,
    is_sealed,
)
from kvstrata.sidecar.objformat_write import (
    FIRST_SEALED_PIECE_BYTES,
    PIECE_BYTES,
    SEALED_PIECE_BYTES,
    SealingPayload,
    StreamedObject,
    encode,
    encode_bytes,
    encode_for_file,
    encode_streamed,
)

if TYPE_CHECKING:
    from kvstrata.sidecar.sealing import KeyRing, StreamCipher

__all__ = [
    "FIRST_SEALED_PIECE_BYTES",
    "FIXED_HEADER_BYTES",
    "FORMAT_VERSION",
    "MAGIC",
    "MAX_NDIM",
    "NONCE_BYTES",
    "PIECE_BYTES",
    "SEALED_FORMAT_VERSION",
    "SEALED_PIECE_BYTES",
    "TAG_BYTES",
    "TRAILER_BYTES",
    "TRAILER_FORMAT_VERSION",
    "ChunkMeta",
    "CorruptObjectError",
    "DecodedObject",
    "ObjectHeader",
    "OpenedInto",
    "PayloadHasher",
    "Seal",
    "SealError",
    "SealingPayload",
    "StreamedObject",
    "check_meta",
    "decode",
    "decode_header",
    "encode",
    "encode_bytes",
    "encode_for_file",
    "encode_streamed",
    "is_sealed",
    "open_sealed",
    "opening_stream",
    "payload_matches",
]


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
    seal: Seal | None = None  # version 4: encrypted; a 16-byte tag follows the payload

    @property
    def trailer_bytes(self) -> int:
        """Bytes after the payload: a checksum (version 3), a tag (4) or none (2)."""
        return TAG_BYTES if self.seal is not None else TRAILER_BYTES if self.trailer else 0

    @property
    def object_length(self) -> int:
        return self.header_length + self.stored_length + self.trailer_bytes


def decode_header(prefix: bytes | memoryview, expected_key: bytes | None = None) -> ObjectHeader:
    """Validate the header at the start of ``prefix`` (which may hold more bytes).

    For readers that place the payload themselves (the disk tier reads it
    straight into the L1 arena). Raises :class:`CorruptObjectError`.
    """
    view = memoryview(prefix).cast("B")
    if len(view) < FIXED_HEADER_BYTES:
        raise CorruptObjectError(f"object of {len(view)} bytes is shorter than a header")
    magic, version, codec_id, ndim, dtype_raw, raw_len, stored_len, checksum, header_checksum = (
        FIXED.unpack_from(view, 0)
    )
    if magic != MAGIC:
        raise CorruptObjectError(f"bad magic {bytes(magic)!r}")
    if version not in (FORMAT_VERSION, TRAILER_FORMAT_VERSION, SEALED_FORMAT_VERSION):
        raise CorruptObjectError(f"unsupported format version {version}")
    if ndim > MAX_NDIM or codec_id not in CODEC_NAMES:
        raise CorruptObjectError("bad ndim or codec id")
    shape_end = FIXED_HEADER_BYTES + 8 * ndim + 2  # shape, then the block count
    if len(view) < shape_end + 1:
        raise CorruptObjectError("object truncated inside its header")
    key_end = header_end = shape_end + 1 + view[shape_end]
    if len(view) < header_end:
        raise CorruptObjectError("object truncated inside its key")
    seal = None
    if version == SEALED_FORMAT_VERSION:
        seal, header_end = _read_seal(view, key_end)
    tail = bytes(view[FIXED_HEADER_BYTES:header_end])
    if xxhash.xxh3_64_intdigest(bytes(view[:48]) + tail) != header_checksum:
        raise CorruptObjectError("header checksum mismatch")
    key = bytes(view[shape_end + 1 : key_end])
    if expected_key is not None and key != expected_key:
        raise CorruptObjectError("object holds a different key")
    *shape, blocks = struct.unpack_from(f"<{ndim}QH", view, FIXED_HEADER_BYTES)
    meta = ChunkMeta(
        dtype=dtype_raw.rstrip(b"\0").decode("ascii"),
        shape=tuple(shape),
        blocks=blocks,
        # A sealed object names the tenant whose key sealed it: read back
        # (L2 re-indexed after a restart, a promotion), the chunk is that
        # tenant's again. Only its key opens it, so a forged label is a miss.
        # The reader checks the name against its own tenants before use.
        tenant=seal.label if seal is not None else "",
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
        seal=seal,
    )


def _read_seal(view: memoryview, at: int) -> tuple[Seal, int]:
    """The seal starting at ``at`` and where the header ends after it."""
    try:
        id_len = view[at]
        key_id = bytes(view[at + 1 : at + 1 + id_len]).decode("ascii")
        at += 1 + id_len
        label_len = view[at]
        label = bytes(view[at + 1 : at + 1 + label_len]).decode()
        at += 1 + label_len
        nonce = bytes(view[at : at + NONCE_BYTES])
    except (IndexError, UnicodeDecodeError):
        raise CorruptObjectError("object truncated or garbled inside its seal") from None
    if len(nonce) != NONCE_BYTES or len(key_id) != id_len:
        raise CorruptObjectError("object truncated inside its seal")
    return Seal(key_id, label, nonce), at + NONCE_BYTES


def open_sealed(
    view: memoryview,
    header: ObjectHeader,
    keys: KeyRing | None,
    in_place: bool = False,
) -> bytes | memoryview:
    """The stored payload (after decryption, before the codec) of a whole
    object whose header is ``header``; raise :class:`SealError` when it is
    sealed and cannot be opened, or plaintext where encryption is required.

    ``in_place``: the caller owns ``view`` (writable) and reads it only
    through what this returns: the plaintext is written over the ciphertext
    (AES-GCM allows it), so a sealed read costs no buffer and no copy of its
    own over a plaintext one. A tag that fails leaves ``view`` garbled."""
    if header.seal is None:
        if keys is not None:
            keys.check_plaintext()
        return view[header.header_length : header.header_length + header.stored_length]
    if keys is None:
        raise SealError("no_key", "sealed object and no encryption keys configured")
    if len(view) != header.object_length:
        raise CorruptObjectError(f"object of {len(view)} bytes, header says {header.object_length}")
    seal = header.seal
    aad = bytes(view[: header.header_length])
    sealed = view[header.header_length :]
    if in_place and not view.readonly:
        out = sealed[: header.stored_length]
        keys.decrypt_into(seal.key_id, seal.label, seal.nonce, sealed, aad, out)
        return out
    return keys.decrypt(seal.key_id, seal.label, seal.nonce, sealed, aad)


def opening_stream(header: ObjectHeader, head: memoryview, keys: KeyRing | None) -> StreamCipher:
    """The cipher that opens the payload of the sealed object whose header is
    ``header`` (its bytes at the start of ``head``, the tag's associated data),
    for a reader that opens it as it arrives; :class:`SealError` when ``keys``
    cannot."""
    if keys is None or header.seal is None:
        raise SealError("no_key", "sealed object and no encryption keys configured")
    seal = header.seal
    aad = bytes(head[: header.header_length])
    return keys.opening_stream(seal.key_id, seal.label, seal.nonce, aad)


class OpenedInto:
    """A sealed, uncompressed object opened as its bytes arrive, the
    plaintext going straight into ``out`` (an L1 slot): the payload sink of
    an L2 read (:func:`~kvstrata.sidecar.tiers.direct_io.read_object`).

    :meth:`begin` reads the header (:class:`CorruptObjectError` if it is
    not such an object for ``expected_key``; :class:`SealError` if ``keys``
    cannot open it), :meth:`take` opens each piece, and :meth:`finish`
    checks the tag: until it returns, ``out`` holds unauthenticated bytes
    that nobody may read, and when it raises, garbage.
    """

    __slots__ = ("_cipher_bytes", "_expected_key", "_keys", "_out", "_stream", "_tag", "header")

    def __init__(self, keys: KeyRing | None, expected_key: bytes, out: memoryview) -> None:
        self._keys = keys
        self._expected_key = expected_key
        self._out = out
        self._tag = bytearray(TAG_BYTES)
        self._stream: StreamCipher | None = None
        self._cipher_bytes = 0
        self.header: ObjectHeader | None = None

    def begin(self, head: memoryview) -> None:
        header = decode_header(head, self._expected_key)
        if header.seal is None or header.codec != "none":
            raise CorruptObjectError("not the sealed uncompressed object the index recorded")
        if header.raw_length != header.stored_length or header.stored_length > len(self._out):
            raise CorruptObjectError("sealed payload longer than its destination")
        self._stream = opening_stream(header, head, self._keys)
        self._cipher_bytes = header.stored_length
        self.header = header

    def take(self, at: int, piece: memoryview) -> None:
        if self._stream is None:
            raise CorruptObjectError("payload before its header")
        k = max(min(len(piece), self._cipher_bytes - at), 0)
        if k:
            self._stream.apply_into(piece[:k], self._out[at:])
        if k < len(piece):  # the tag's bytes
            start = at + k - self._cipher_bytes
            if start + len(piece) - k > TAG_BYTES:
                raise CorruptObjectError("bytes past a sealed object's tag")
            self._tag[start : start + len(piece) - k] = piece[k:]

    def finish(self) -> ObjectHeader:
        """The header, once the tag checked every byte (:class:`SealError` if not)."""
        if self._stream is None or self.header is None:
            raise CorruptObjectError("sealed object ended before its payload")
        self._stream.verify(self._tag)
        return self.header


def decode(
    blob: bytes | memoryview,
    expected_key: bytes | None = None,
    payload_xxh3: int | None = None,
    keys: KeyRing | None = None,
    in_place: bool = False,
) -> DecodedObject:
    """Validate and decode one whole object; raise :class:`CorruptObjectError`
    (:class:`SealError` for what ``keys`` cannot open or must not serve).
    ``in_place``: a sealed object is opened over its own bytes (:func:`open_sealed`).

    ``payload_xxh3``: the stored payload's xxh3_64, when the reader already
    computed it while the bytes arrived (:class:`PayloadHasher`); it is then
    checked against the recorded checksum instead of hashing the payload again.
    """
    view = memoryview(blob).cast("B")
    header = decode_header(view, expected_key)
    if header.seal is not None:
        return _decoded(header, open_sealed(view, header, keys, in_place))
    if keys is not None:
        keys.check_plaintext()
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
    return _decoded(header, stored)


def _decoded(header: ObjectHeader, stored: bytes | memoryview) -> DecodedObject:
    """The payload of checked ``stored`` bytes, decompressed as the header says."""
    if len(stored) != header.stored_length:
        raise CorruptObjectError(f"payload length {len(stored)} != recorded {header.stored_length}")
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
    # MAX_NDIM shape words, the block count, a key of at most 255 bytes and
    # a seal: key id and tenant label of at most 255 bytes each, a nonce).
    HEADER_BYTES_MAX = FIXED_HEADER_BYTES + 8 * MAX_NDIM + 3 + 255 + 2 + 2 * 255 + NONCE_BYTES

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
            if header.seal is not None:  # the tag checks it, not a checksum
                self._header_probe = self._size + 1
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
        and header.seal is None
        and len(stored) == header.stored_length
        and (xxhash.xxh3_64_intdigest(stored) == header.checksum)
    )
