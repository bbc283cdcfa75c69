"""GET replies read straight off the socket, one buffer per value, each payload
hashed while the rest of the reply is still arriving.

Why not redis-py's reader: with hiredis, a reply is received into redis-py's
read buffer, fed into hiredis' own buffer and then copied into a new ``bytes``;
the tier then hashed the payload in a pass of its own after the last byte.
That made every GET cost more CPU per byte than the raw client's, and cells
of ``kvstrata bench remote`` 8 to 16% below it (bench/results/remote.json,
before this module). Here each value is received once, by the kernel's copy
into its buffer, and :class:`~kvstrata.sidecar.objformat.PayloadHasher`
hashes what each receive brought, so the checksum overlaps the transfer.

Only what a GET can answer is parsed (bulk strings, RESP2's and RESP3's
nulls, simple errors);
anything else, a short read or a deadline closes the connection, so a
reply is never left half-read on a pooled connection. Used for standalone
servers; a cluster client's pipelines route by slot and keep redis-py's path.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Any

import numpy as np
import redis.exceptions
from redis._parsers import BaseParser

from kvstrata.sidecar.objformat import CorruptObjectError, PayloadHasher, decode
from kvstrata.sidecar.tiers.remote import Fetched, Validated

# A reply line ("$<length>", "-ERR ...") longer than this is not a GET's.
_MAX_LINE = 64 * 1024
_LINE_BUFFER = 64 * 1024


class _Replies:
    """Replies to GETs on one connected socket, in order."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buf = bytearray(_LINE_BUFFER)
        self._start = 0  # unread bytes are _buf[_start:_end]
        self._end = 0

    def _fill(self) -> None:
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buf):
            unread = self._end - self._start
            self._buf[:unread] = self._buf[self._start : self._end]
            self._start, self._end = 0, unread
        received = self._sock.recv_into(memoryview(self._buf)[self._end :])
        if received == 0:
            raise redis.exceptions.ConnectionError("connection closed by the server")
        self._end += received

    def _line(self) -> bytes:
        while True:
            at = self._buf.find(b"\r\n", self._start, self._end)
            if at >= 0:
                line = bytes(self._buf[self._start : at])
                self._start = at + 2
                return line
            if self._end - self._start >= _MAX_LINE:
                raise redis.exceptions.InvalidResponse("reply line too long for a GET")
            self._fill()

    def _exactly(self, out: memoryview, hasher: PayloadHasher | None = None) -> None:
        """Fill ``out``: buffered bytes first, then straight from the socket."""
        filled = min(len(out), self._end - self._start)
        out[:filled] = self._buf[self._start : self._start + filled]
        self._start += filled
        if hasher is not None:
            hasher.received(filled)
        while filled < len(out):
            received = self._sock.recv_into(out[filled:])
            if received == 0:
                raise redis.exceptions.ConnectionError("connection closed inside a reply")
            filled += received
            if hasher is not None:
                hasher.received(filled)

    def value(self, expected_key: bytes) -> Fetched:
        """The next reply: None for nil, a validated object, or the bytes of one
        that failed validation (the tier counts it corrupt and deletes it)."""
        line = self._line()
        if line[:1] == b"-":
            raise BaseParser.parse_error(line[1:].decode(errors="replace"))
        if line == b"_":  # RESP3's null (redis-py 8 speaks RESP3 where the server does)
            return None
        if line[:1] != b"$":
            raise redis.exceptions.InvalidResponse(f"unexpected reply to GET: {line[:32]!r}")
        try:
            size = int(line[1:])
        except ValueError:
            raise redis.exceptions.InvalidResponse(f"bad bulk length {line[:32]!r}") from None
        if size < 0:
            return None
        # Uninitialised: every byte of it is received over before it is read.
        view = memoryview(np.empty(size, dtype=np.uint8)).cast("B")
        hasher = PayloadHasher(view)
        self._exactly(view, hasher)
        end = bytearray(2)
        self._exactly(memoryview(end))
        if end != b"\r\n":
            raise redis.exceptions.InvalidResponse("bulk string not ended by CRLF")
        try:
            return Validated(decode(view, expected_key, hasher.digest()), size)
        except CorruptObjectError:
            return view


def get_many(pool: Any, names: Sequence[str], keys: Sequence[bytes]) -> list[Fetched]:
    """Pipelined GETs of ``names`` on one pooled connection; ``keys`` are the
    chunk keys each object must hold. Raises redis-py's exceptions.

    A connection that broke before the reply (a pooled socket gone stale
    when the server restarted) is retried once at once on a new one, as the
    client's other commands are; a deadline is not retried.
    """
    for attempt in (1, 2):
        conn = pool.get_connection()
        try:
            return _get_on(conn, names, keys)
        except redis.exceptions.ConnectionError:
            conn.disconnect()
            if attempt == 2:
                raise
        except BaseException:
            conn.disconnect()  # never pool a connection with a reply half-read
            raise
        finally:
            pool.release(conn)
    raise AssertionError("unreachable")


def _get_on(conn: Any, names: Sequence[str], keys: Sequence[bytes]) -> list[Fetched]:
    conn.send_packed_command(conn.pack_commands([("GET", name) for name in names]))
    sock = conn._sock  # redis-py's connected socket (AbstractConnection._sock)
    if sock is None:
        raise redis.exceptions.ConnectionError("connection closed after sending")
    replies = _Replies(sock)
    try:
        return [replies.value(key) for key in keys]
    except TimeoutError:  # socket.timeout: the socket's deadline
        raise redis.exceptions.TimeoutError("Timeout reading from socket") from None
    except OSError as exc:
        raise redis.exceptions.ConnectionError(f"Error while reading from socket: {exc}") from None
