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

import xxhash

from kvstrata.sidecar.allocator import align_up

__all__ = ["ALIGN", "SEGMENT_BYTES", "open_direct", "read_object", "supported", "write_object"]

ALIGN = 4096
SEGMENT_BYTES = 2 << 20  # per thread doing L2 I/O; measured against 1 and 4 MiB (docs)

_O_DIRECT = getattr(os, "O_DIRECT", 0)
_local = threading.local()


def _buffer() -> memoryview:
    """This thread's aligned segment buffer (anonymous mappings start on a page)."""
    buf = getattr(_local, "buf", None)
    if buf is None:
        buf = _local.buf = memoryview(mmap.mmap(-1, SEGMENT_BYTES))
    return buf


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


def write_object(fd: int, pieces: list[memoryview]) -> int:
    """Write ``pieces`` one after the other from offset 0 of ``fd`` (opened
    with ``O_DIRECT``), then truncate the file to their total; that total."""
    buf = _buffer()
    offset = fill = 0
    for piece in pieces:
        pos = 0
        while pos < len(piece):
            n = min(len(buf) - fill, len(piece) - pos)
            buf[fill : fill + n] = piece[pos : pos + n]
            fill += n
            pos += n
            if fill == len(buf):
                _pwrite_all(fd, buf, offset)
                offset += fill
                fill = 0
    total = offset + fill
    if fill:
        padded = align_up(fill, ALIGN)
        buf[fill:padded] = bytes(padded - fill)
        _pwrite_all(fd, buf[:padded], offset)
        os.ftruncate(fd, total)
    return total


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while len(view):
        n = os.pwrite(fd, view, offset)
        if n <= 0 or (n < len(view) and n % ALIGN):
            # The rest would start unaligned, which O_DIRECT refuses.
            raise OSError(errno.EIO, f"direct write of {len(view)} bytes wrote {n}")
        view = view[n:]
        offset += n


def read_object(fd: int, head: memoryview, payload: memoryview) -> tuple[int, int, int]:
    """Read the file ``fd`` (opened with ``O_DIRECT``) from offset 0: its first
    ``len(head)`` bytes into ``head``, the next ``len(payload)`` into
    ``payload``. (header bytes read, payload bytes read, xxh3_64 of those
    payload bytes); fewer than asked where the file ends first."""
    buf = _buffer()
    hasher = xxhash.xxh3_64()
    want_head, want = len(head), len(head) + len(payload)
    offset = got_head = got = 0
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
        start = max(offset - want_head, 0)
        k = min(len(segment), len(payload) - start)
        if k > 0:
            piece = segment[:k]
            payload[start : start + k] = piece
            hasher.update(piece)
            got += k
        offset += n
        if n < len(buf):  # the end of the file
            break
    return got_head, got, hasher.intdigest()
