"""The disk tier's file I/O: whole objects written and read past the page cache where allowed.

Why a module of its own: how a file's bytes reach the disk is apart from
which files the tier keeps (:mod:`.disk`). :class:`DiskFiles` writes an
object under a temporary name and renames it into place (a crash leaves
the old state or a stray temp file, never a half object under a real
name), and reads a file's header and payload into buffers the caller
names, the payload hashed segment by segment while it is still in the CPU
cache. Both go through ``O_DIRECT`` (:mod:`.direct_io`) until the
filesystem refuses it once; then through the page cache, said once in the
log. The bytes on disk are the same either way.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets

from kvstrata.sidecar.objformat import SealingPayload
from kvstrata.sidecar.tierchoice import TierChoice
from kvstrata.sidecar.tiers import direct_io
from kvstrata.sidecar.tiers.file_choice import record_choice

__all__ = ["SEGMENT_BYTES", "TMP_MARK", "DiskFiles"]

logger = logging.getLogger("kvstrata.sidecar.tiers.disk")

TMP_MARK = ".tmp-"  # <final name>.tmp-<rand>: a write in progress
SEGMENT_BYTES = 256 << 10  # read+hash unit: fits in L2 cache, measured best of 256K/1M/4M


class DiskFiles:
    """Writes and reads the tier's files (module docstring); ``fsync``: each
    write is flushed to the device before it is renamed into place."""

    def __init__(self, root: str, *, direct: bool, fsync: bool) -> None:
        self.root = root
        self.direct_io = direct  # False once the filesystem refused O_DIRECT
        self.fsync = fsync

    def write(
        self, final: str, pieces: list[memoryview | SealingPayload], choice: TierChoice = None
    ) -> None:
        """``final`` holding ``pieces`` and its store ``choice`` (.file_choice),
        complete or not at all; OSError (the temporary file removed) when it
        cannot be written, ChoiceNotRecorded when the choice cannot be kept."""
        tmp = f"{final}{TMP_MARK}{secrets.token_hex(4)}"
        try:
            os.makedirs(os.path.dirname(final), exist_ok=True)
            self._write_tmp(tmp, pieces)
            record_choice(tmp, choice)
            os.replace(tmp, final)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def read(
        self, path: str, head: bytearray | memoryview, length: int, sink: direct_io.PayloadSink
    ) -> tuple[int, int, int]:
        """Read the header into ``head`` and the next ``length`` bytes, the
        payload, into ``sink`` (:class:`~.direct_io.HashingCopy`, or a sealed
        object's opener): (header bytes, payload bytes, file size)."""
        if self.direct_io:
            fd = direct_io.open_direct(path, os.O_RDONLY)
            if fd is not None:
                try:
                    got_head, got = direct_io.read_object(fd, memoryview(head), length, sink)
                    return got_head, got, os.fstat(fd).st_size
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
                finally:
                    os.close(fd)
            self._no_direct_io()
        fd = os.open(path, os.O_RDONLY)
        try:
            with contextlib.suppress(OSError, AttributeError):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            if not isinstance(sink, direct_io.HashingCopy):  # through the segment buffer
                got_head, got = direct_io.read_object(fd, memoryview(head), length, sink)
                return got_head, got, os.fstat(fd).st_size
            got_head = _read_all(fd, [head], len(head))
            sink.begin(memoryview(head))
            got = _read_hashed(fd, sink, len(head))  # straight into the target: no buffer between
            return got_head, got, os.fstat(fd).st_size
        finally:
            os.close(fd)

    def _write_tmp(self, tmp: str, pieces: list[memoryview | SealingPayload]) -> None:
        """Create ``tmp`` holding ``pieces``: past the page cache where the
        filesystem allows (a refusal, at open or at the first write, turns
        direct I/O off for good)."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
        if self.direct_io:
            fd = direct_io.open_direct(tmp, flags)
            if fd is not None:
                try:
                    direct_io.write_object(fd, pieces)
                    if self.fsync:
                        os.fsync(fd)
                    return
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
                finally:
                    os.close(fd)
                os.unlink(tmp)
            self._no_direct_io()
        fd = os.open(tmp, flags, 0o600)
        try:
            views = [p for p in pieces if isinstance(p, memoryview)]
            if len(views) == len(pieces):
                _write_all(fd, views)
            else:  # a sealed payload seals itself into the segment buffer
                for piece in pieces:
                    if isinstance(piece, SealingPayload):
                        piece.rewind()  # a refused direct write may have sealed some
                direct_io.write_buffered(fd, pieces)
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def _no_direct_io(self) -> None:
        """The filesystem refused O_DIRECT: buffered I/O from now on."""
        if self.direct_io:
            self.direct_io = False
            logger.info("L2 %s: no direct I/O on this filesystem; using the page cache", self.root)


def _write_all(fd: int, buffers: list[memoryview]) -> None:
    """``writev`` until every byte is out (short writes happen on big buffers)."""
    pending = [b for b in buffers if len(b)]
    while pending:
        _consume(pending, os.writev(fd, pending))


def _consume(views: list[memoryview], n: int) -> None:
    """Drop the first ``n`` bytes from a list of buffers after a short vectored I/O."""
    while n and views:
        if n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        else:
            views[0] = views[0][n:]
            n = 0


def _read_hashed(fd: int, sink: direct_io.HashingCopy, offset: int) -> int:
    """``preadv`` into the sink's target from ``offset`` in cache-sized
    segments, hashing each; bytes read."""
    out = sink.target
    done = 0
    while done < len(out):
        segment = out[done : done + SEGMENT_BYTES]
        n = os.preadv(fd, [segment], offset + done)
        if n == 0:
            break
        sink.hashed_in_place(done, n)
        done += n
    return done


def _read_all(fd: int, buffers: list[bytearray | memoryview], total: int) -> int:
    """``preadv`` into ``buffers`` until full or end of file; bytes read."""
    views = [memoryview(b).cast("B") for b in buffers if len(b)]
    done = 0
    while views and done < total:
        n = os.preadv(fd, views, done)
        if n == 0:
            break
        done += n
        _consume(views, n)
    return done
