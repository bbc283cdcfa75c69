"""Chunk files read and written past the page cache (``O_DIRECT``).

Why: a buffered write puts every byte through the page cache, and on the
machine the benchmarks run on that cost up to 2.3 ns of kernel CPU per byte
(allocating pages): 300 ms for the 128 MiB a new replica promotes from the
shared tier on its first request, spent by the L2 writers while that
request waited for the same CPUs. Direct I/O moved the same bytes for 3 ms
of system time, 40 ms with the copy through the aligned buffer below
(``docs/benchmarks.md``). A chunk in L2 is in L1 too, or on its way there,
so a third copy in the page cache buys little, and the page cache is
charged to the sidecar's memory cgroup besides.

How: the file keeps its layout (:mod:`..objformat`: header, then payload)
and its bytes pass through one page-aligned buffer per thread
(:data:`SEGMENT_BYTES`), since ``O_DIRECT`` wants aligned addresses, file
offsets and lengths (open(2), "O_DIRECT") and the arena's slots are aligned
to 256 bytes only. A write fills the buffer with header and payload pieces
and writes each full segment at its offset; the last one is padded to
:data:`ALIGN` and the file truncated to its true length. A read reads
whole segments and copies the header and the payload out, hashing each
payload piece while it is still in the CPU cache. The copy through the
buffer is a memcpy, a small fraction of what the page cache cost.

:data:`ALIGN` (4096) satisfies every logical block size up to 4096 bytes.
Where a filesystem refuses ``O_DIRECT`` (``EINVAL`` at open, as tmpfs did on
older kernels, or at the first write) the caller falls back to buffered I/O:
:func:`open_direct` says so for the open.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

import xxhash

from kvstrata.sidecar.allocator import align_up

if TYPE_CHECKING:
    from kvstrata.sidecar.objformat import SealingPayload

__all__ = [
    "ALIGN",
    "SEGMENT_BYTES",
    "HashingCopy",
    "PayloadSink",
    "open_direct",
    "read_object",
    "supported",
    "write_buffered",
    "write_object",
]

ALIGN = 4096
SEGMENT_BYTES = 2 << 20  # per thread doing L2 I/O; measured against 1 and 4 MiB (docs)

_O_DIRECT = getattr(os, "O_DIRECT", 0)
_local = threading.local()


# Past the segment, room a cipher sealing into the buffer's end writes into
# (StreamCipher.apply_into); never written to the file.
_SLACK = ALIGN


def _buffer(slack: bool = False) -> memoryview:
    """This thread's aligned segment buffer (anonymous mappings start on a
    page), with the room past it when ``slack``."""
    buf = getattr(_local, "buf", None)
    if buf is None:
        buf = _local.buf = memoryview(mmap.mmap(-1, SEGMENT_BYTES + _SLACK))
    return buf if slack else buf[:SEGMENT_BYTES]


def open_direct(path: str, flags: int, mode: int = 0o600) -> int | None:
    """``os.open`` with ``O_DIRECT``; None where the filesystem or platform has
    no direct I/O (the caller opens the file buffered). Other errors raise."""
    if not _O_DIRECT:
        return None
    try:
        return os.open(path, flags | _O_DIRECT, mode)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return None
        raise


def supported(directory: str) -> bool:
    """Whether files in ``directory`` can be opened with ``O_DIRECT`` (a probe
    file is created and removed)."""
    probe = os.path.join(directory, f".direct-io-probe-{os.getpid()}")
    fd = open_direct(probe, os.O_WRONLY | os.O_CREAT)
    if fd is None:
        return False
    os.close(fd)
    os.unlink(probe)
    return True


def _segments(
    pieces: list[memoryview | SealingPayload],
) -> Iterator[tuple[int, memoryview, bool]]:
    """``pieces`` gathered into this thread's buffer: (file offset, segment,
    whether it is the last), every segment but the last one full. A
    :class:`SealingPayload` seals itself straight into the buffer, so its
    ciphertext costs no copy of its own. Each segment is written before the
    next is asked for: the buffer is reused."""
    room = _buffer(slack=True)
    buf = room[:SEGMENT_BYTES]
    offset = fill = 0
    for piece in pieces:
        pos = 0
        while pos < len(piece):
            n = min(len(buf) - fill, len(piece) - pos)
            if isinstance(piece, memoryview):
                buf[fill : fill + n] = piece[pos : pos + n]
            else:
                piece.produce_into(room[fill:], n)
            fill += n
            pos += n
            if fill == len(buf):
                yield offset, buf, False
                offset += fill
                fill = 0
    yield offset, buf[:fill], True


def write_object(fd: int, pieces: list[memoryview | SealingPayload]) -> int:
    """Write ``pieces`` one after the other from offset 0 of ``fd`` (opened
    with ``O_DIRECT``), then truncate the file to their total; that total."""
    total = 0
    for offset, segment, last in _segments(pieces):
        total = offset + len(segment)
        if not last:
            _pwrite_all(fd, segment, offset)
        elif len(segment):
            padded = align_up(len(segment), ALIGN)
            room = _buffer(slack=True)
            room[len(segment) : padded] = bytes(padded - len(segment))
            _pwrite_all(fd, room[:padded], offset)
            os.ftruncate(fd, total)
    return total


def write_buffered(fd: int, pieces: list[memoryview | SealingPayload]) -> int:
    """:func:`write_object` for a file opened without ``O_DIRECT``: the same
    bytes through the same buffer (a sealed payload seals into it), no
    padding; the total written."""
    total = 0
    for offset, segment, _ in _segments(pieces):
        at = 0
        while at < len(segment):
            at += os.pwrite(fd, segment[at:], offset + at)
        total = offset + len(segment)
    return total


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while len(view):
        n = os.pwrite(fd, view, offset)
        if n <= 0 or (n < len(view) and n % ALIGN):
            # The rest would start unaligned, which O_DIRECT refuses.
            raise OSError(errno.EIO, f"direct write of {len(view)} bytes wrote {n}")
        view = view[n:]
        offset += n


class PayloadSink(Protocol):
    """Where :func:`read_object` puts a file's payload, segment by segment."""

    def begin(self, head: memoryview) -> None:
        """The header is in ``head`` (called once, before the first payload piece)."""

    def take(self, at: int, piece: memoryview) -> None:
        """``piece`` holds the payload's bytes from offset ``at`` (in order; the
        segment buffer is reused once this returns)."""


class HashingCopy:
    """A plaintext payload copied into ``target``, hashed while it is still
    in the CPU cache: :attr:`digest` is its xxh3_64."""

    __slots__ = ("_hasher", "target")

    def __init__(self, target: memoryview) -> None:
        self.target = target
        self._hasher = xxhash.xxh3_64()

    def begin(self, head: memoryview) -> None:
        pass

    def take(self, at: int, piece: memoryview) -> None:
        self.target[at : at + len(piece)] = piece
        self._hasher.update(piece)

    def hashed_in_place(self, at: int, n: int) -> None:
        """The reader put ``n`` bytes at ``at`` of the target itself: hash them."""
        self._hasher.update(self.target[at : at + n])

    @property
    def digest(self) -> int:
        return self._hasher.intdigest()


def read_object(fd: int, head: memoryview, length: int, sink: PayloadSink) -> tuple[int, int]:
    """Read the file ``fd`` (opened with ``O_DIRECT``; a buffered one works
    too) from offset 0: its first ``len(head)`` bytes into ``head``, the next
    ``length`` handed to ``sink`` a segment at a time. (header bytes read,
    payload bytes read); fewer than asked where the file ends first."""
    buf = _buffer()
    want_head, want = len(head), len(head) + length
    offset = got_head = got = 0
    begun = False
    while offset < want:
        n = os.preadv(fd, [buf], offset)
        if n <= 0:
            break
        segment = buf[:n]
        if offset < want_head:  # the header (never past the first segment in practice)
            k = min(n, want_head - offset)
            head[offset : offset + k] = segment[:k]
            got_head += k
            segment = segment[k:]
        if not begun and got_head == want_head:
            sink.begin(head)
            begun = True
        start = max(offset - want_head, 0)
        k = min(len(segment), length - start)
        if k > 0:
            sink.take(start, segment[:k])
            got += k
        offset += n
        if n < len(buf):  # the end of the file
            break
    return got_head, got
