"""An object received from a stream straight into the L1 slot reserved for it.

Why its own module: the Valkey tier (off its socket, :mod:`.valkey_get`) and
the S3 tier (off a GET's body, :mod:`.s3body`) receive an object the same
way. The header comes first; once it says the payload's length and meta,
``place`` reserves the destination (an L1 slot) and the payload is received
into it, hashed piece by piece while the rest is still arriving, so a chunk
is copied once, by the kernel, into L1 and the checksum costs no pass of its
own. A sealed one is received into the slot the same way and opened there,
piece by piece as it arrives (:class:`OpenedInPlace`; AES-GCM opens a
buffer over itself), so it costs the cipher's pass in place of the hash's.
A compressed object (or one whose header does not add up) is received
whole, decoded (decrypted), then copied.

A stream is two callables: ``fill(out, hasher, base)`` fills ``out``
exactly (raising when the stream ends first) and tells ``hasher`` how many
bytes from ``base`` on are in; ``skip(n)`` passes over ``n`` bytes nobody
will keep (a stream that is closed afterwards need not read them).
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import xxhash

from kvstrata.sidecar.objformat import (
    ChunkMeta,
    CorruptObjectError,
    ObjectHeader,
    PayloadHasher,
    SealError,
    decode,
    decode_header,
    opening_stream,
)
from kvstrata.sidecar.tiers.base import Place, copy_placed
from kvstrata.sidecar.tiers.remote import Fetched, Validated

if TYPE_CHECKING:
    from kvstrata.sidecar.sealing import KeyRing, StreamCipher

__all__ = ["Fill", "Placed", "Receiver", "RunningHash", "receive_into", "receive_whole"]


class Receiver(Protocol):
    def received(self, filled: int) -> None: ...


Fill = Callable[[memoryview, "Receiver | None", int], None]


class RunningHash:
    """xxh3_64 of a view, hashed as its bytes arrive (``received``)."""

    def __init__(self, view: memoryview) -> None:
        self._view = view
        self._hash = xxhash.xxh3_64()
        self._hashed = 0

    def received(self, filled: int) -> None:
        if filled > self._hashed:
            self._hash.update(self._view[self._hashed : filled])
            self._hashed = filled

    def intdigest(self) -> int:
        return self._hash.intdigest()


class OpenedInPlace:
    """A sealed payload opened where it is received, as its bytes arrive
    (``received``); its tag is checked by :meth:`StreamCipher.verify` once
    the last byte is in, and nobody reads the view before that."""

    def __init__(self, view: memoryview, stream: StreamCipher) -> None:
        self._view = view
        self._stream = stream
        self._opened = 0

    def received(self, filled: int) -> None:
        if filled > self._opened:
            self._stream.apply_into(self._view[self._opened : filled], self._view[self._opened :])
            self._opened = filled

    def verify(self, tag: bytes | bytearray) -> None:
        """Every byte is in: SealError unless ``tag`` authenticates them."""
        self._stream.verify(tag)


@dataclass(frozen=True, slots=True)
class Placed:
    """What :func:`receive_into` read: ``meta`` when the validated payload is
    where ``place`` said (None: nowhere to put it, or ``corrupt``)."""

    meta: ChunkMeta | None
    nbytes: int  # the stored object's length
    corrupt: bool = False
    # Why a sealed object was not opened (or a plaintext one not served): the
    # reason of kvstrata_decrypt_failures_total; "" otherwise.
    seal_failure: str = ""


# A buffer this large is a fresh mapping each time: glibc's malloc maps
# anything from its largest mmap threshold (32 MiB on 64-bit) on, where a
# smaller one usually reuses memory freed by the last object. For a fresh
# mapping numpy asks the kernel for transparent huge pages (madvise
# MADV_HUGEPAGE, on arrays of 4 MiB and more), and those cost far more on
# some calls than on others. Measured on the 2-core build VM, bench remote's
# S3 GETs of 32 MiB objects one at a time: the tier's CPU per byte moved
# between 0.41 and 1.34 ns over five runs with numpy's buffers (0.76-0.80 ns
# with numpy's huge pages turned off), and stayed at 0.72-0.77 ns with a
# private mapping of plain pages over four runs, batches of 8 included (the
# raw client's 0.65-0.82 ns). 16 MiB objects cost 0.36-0.38 ns in numpy's
# (reused) buffers and 0.84-0.86 ns in fresh mappings: smaller buffers stay numpy's.
PLAIN_PAGES_FROM_BYTES = 32 << 20


def _fresh_buffer(size: int) -> memoryview:
    """An uninitialised buffer of ``size`` bytes (every byte is received over
    before it is read): plain pages of an anonymous mapping for a large one,
    faulted in as they are first written, with no zeroing pass of ours."""
    if size >= PLAIN_PAGES_FROM_BYTES:
        # Private: a shared anonymous mapping is backed by shmem, whose page
        # faults cost more.
        return memoryview(mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS))
    return memoryview(np.empty(size, dtype=np.uint8)).cast("B")


def receive_whole(
    size: int, head: memoryview, expected_key: bytes, fill: Fill, keys: KeyRing | None = None
) -> Fetched:
    """An object of ``size`` bytes whose first bytes ``head`` are already read,
    received into one buffer and checked: validated (opened with ``keys``
    when sealed), or the bytes of one that failed validation (the tier
    decodes them again to count why, and deletes it)."""
    view = _fresh_buffer(size)
    view[: len(head)] = head
    hasher = PayloadHasher(view)
    fill(view[len(head) :], hasher, len(head))
    try:
        # The buffer is this call's own: a sealed object is opened over itself.
        return Validated(decode(view, expected_key, hasher.digest(), keys, in_place=True), size)
    except CorruptObjectError:
        return view


def receive_into(
    size: int,
    expected_key: bytes,
    place: Place,
    fill: Fill,
    skip: Callable[[int], None],
    keys: KeyRing | None = None,
) -> Placed:
    """An object of ``size`` bytes, its payload received straight into what
    ``place`` names once the header says its length (module docstring). On
    return every one of the ``size`` bytes was received or skipped."""
    head = memoryview(bytearray(min(size, PayloadHasher.HEADER_BYTES_MAX)))
    fill(head, None, 0)
    try:
        header = decode_header(head, expected_key)
    except CorruptObjectError:
        skip(size - len(head))
        return Placed(None, size, corrupt=True)
    if header.seal is None and keys is not None and keys.mode == "required":
        skip(size - len(head))
        return Placed(None, size, seal_failure="plaintext")
    trailer = header.trailer_bytes
    payload_bytes = header.stored_length
    if (
        header.codec != "none"
        or header.raw_length != payload_bytes
        or header.header_length + payload_bytes + trailer != size
    ):
        # Compressed (or not what its header says): decode it whole, then copy.
        got = receive_whole(size, head, expected_key, fill, keys)
        if not isinstance(got, Validated):
            return _refused(got, expected_key, keys, size)
        return Placed(copy_placed(got.obj, place), size)
    try:
        stream = opening_stream(header, head, keys) if header.seal is not None else None
    except SealError as exc:
        skip(size - len(head))
        return Placed(None, size, seal_failure=exc.reason)
    dest = place(payload_bytes, header.meta)
    if dest is None:
        skip(size - len(head))
        return Placed(None, size)
    early = head[header.header_length :]  # payload (and trailer) bytes read with the header
    first = min(len(early), payload_bytes)
    dest[:first] = early[:first]
    receiver = RunningHash(dest) if stream is None else OpenedInPlace(dest, stream)
    receiver.received(first)
    fill(dest[first:], receiver, first)
    tail = bytearray(early[first:])  # the trailer's bytes read with the header
    more = bytearray(trailer - len(tail))
    fill(memoryview(more), None, 0)
    return _verdict(header, receiver, tail + more, size)


def _verdict(
    header: ObjectHeader, receiver: RunningHash | OpenedInPlace, trailer: bytearray, size: int
) -> Placed:
    """A payload received into its place, judged by its trailer: the tag of a
    sealed one, the checksum of a plaintext one (in its header for version 2)."""
    if isinstance(receiver, OpenedInPlace):
        try:
            receiver.verify(trailer)
        except SealError as exc:
            return Placed(None, size, seal_failure=exc.reason)
        return Placed(header.meta, size)
    checksum = struct.unpack_from("<Q", trailer)[0] if trailer else header.checksum
    if receiver.intdigest() != checksum:
        return Placed(None, size, corrupt=True)
    return Placed(header.meta, size)


def _refused(got: Fetched, expected_key: bytes, keys: KeyRing | None, size: int) -> Placed:
    """A whole object that failed validation: corrupt, or why it was not opened."""
    if isinstance(got, bytes | memoryview):
        try:
            decode(got, expected_key, keys=keys)
        except SealError as exc:
            return Placed(None, size, seal_failure=exc.reason)
        except CorruptObjectError:
            pass
    return Placed(None, size, corrupt=True)
