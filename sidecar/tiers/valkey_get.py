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
:func:`get_into` goes further for promotions into L1: once the object's
header is in, the payload is received straight into the L1 slot reserved
for it, so a chunk from Valkey is copied once, by the kernel, into L1.

Only what a GET can answer is parsed (bulk strings, RESP2's and RESP3's
nulls, simple errors);
anything else, a short read or a deadline closes the connection, so a
reply is never left half-read on a pooled connection. Used for standalone
servers; a cluster client's pipelines route by slot and keep redis-py's path.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import redis.exceptions
from redis._parsers import BaseParser

from kvstrata.sidecar.objformat import ChunkMeta
from kvstrata.sidecar.tiers.base import Place
from kvstrata.sidecar.tiers.placing import Placed, Receiver, receive_into, receive_whole
from kvstrata.sidecar.tiers.remote import Fetched

if TYPE_CHECKING:
    from kvstrata.sidecar.sealing import KeyRing

T = TypeVar("T")

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

    def _exactly(self, out: memoryview, hasher: Receiver | None = None, base: int = 0) -> None:
        """Fill ``out``: buffered bytes first, then straight from the socket.
        ``hasher`` hears ``base`` + the bytes of ``out`` filled so far."""
        filled = min(len(out), self._end - self._start)
        out[:filled] = self._buf[self._start : self._start + filled]
        self._start += filled
        if hasher is not None:
            hasher.received(base + filled)
        while filled < len(out):
            received = self._sock.recv_into(out[filled:])
            if received == 0:
                raise redis.exceptions.ConnectionError("connection closed inside a reply")
            filled += received
            if hasher is not None:
                hasher.received(base + filled)

    def _crlf(self) -> None:
        """The CRLF that ends a bulk string."""
        end = bytearray(2)
        self._exactly(memoryview(end))
        if end != b"\r\n":
            raise redis.exceptions.InvalidResponse("bulk string not ended by CRLF")

    def value(self, expected_key: bytes, keys: KeyRing | None = None) -> Fetched:
        """The next reply: None for nil, a validated object, or the bytes of one
        that failed validation (the tier counts it corrupt and deletes it)."""
        size = self._bulk_length()  # RESP2's and RESP3's nulls are None
        if size is None:
            return None
        got = receive_whole(size, memoryview(b""), expected_key, self._exactly, keys)
        self._crlf()
        return got

    def _skip(self, n: int) -> None:
        """Read and drop ``n`` bytes (the rest of a value nothing will keep)."""
        scratch = memoryview(bytearray(min(n, _LINE_BUFFER) or 1))
        while n > 0:
            take = min(n, len(scratch))
            self._exactly(scratch[:take])
            n -= take

    def value_into(
        self, expected_key: bytes, place: Place, keys: KeyRing | None = None
    ) -> Placed | None:
        """The next reply, its payload received straight into what ``place``
        names once the header says its length (:func:`.placing.receive_into`);
        None for nil."""
        size = self._bulk_length()
        if size is None:
            return None
        placed = receive_into(size, expected_key, place, self._exactly, self._skip, keys)
        self._crlf()
        return placed

    def _bulk_length(self) -> int | None:
        line = self._line()
        if line[:1] == b"-":
            raise BaseParser.parse_error(line[1:].decode(errors="replace"))
        if line == b"_":
            return None
        if line[:1] != b"$":
            raise redis.exceptions.InvalidResponse(f"unexpected reply to GET: {line[:32]!r}")
        try:
            size = int(line[1:])
        except ValueError:
            raise redis.exceptions.InvalidResponse(f"bad bulk length {line[:32]!r}") from None
        return None if size < 0 else size


def get_into(
    pool: Any, name: str, key: bytes, place: Place, keys: KeyRing | None = None
) -> Placed | None:
    """One GET of ``name`` whose payload lands where ``place`` says (see
    :meth:`_Replies.value_into`). Raises redis-py's exceptions. A broken pooled
    connection is retried once, but only before ``place`` was called: a
    reserved destination is never filled twice."""
    called = False

    def place_once(nbytes: int, meta: ChunkMeta) -> memoryview | None:
        nonlocal called
        called = True
        return place(nbytes, meta)

    return _on_a_connection(
        pool, [name], lambda replies: replies.value_into(key, place_once, keys), lambda: not called
    )


def _on_a_connection(
    pool: Any,
    names: Sequence[str],
    read: Callable[[_Replies], T],
    may_retry: Callable[[], bool] = lambda: True,
) -> T:
    """Send a GET of each name on one pooled connection and ``read`` the replies.

    A connection that broke (a pooled socket gone stale when the server
    restarted) is retried once at once on a new one, as the client's other
    commands are, while ``may_retry`` says so; a deadline is not retried. A
    connection is never pooled with a reply half-read.
    """
    for attempt in (1, 2):
        conn = pool.get_connection()
        try:
            conn.send_packed_command(conn.pack_commands([("GET", name) for name in names]))
            return _read(conn, read)
        except redis.exceptions.ConnectionError:
            conn.disconnect()
            if attempt == 2 or not may_retry():
                raise
        except BaseException:
            conn.disconnect()
            raise
        finally:
            pool.release(conn)
    raise AssertionError("unreachable")


def _read(conn: Any, read: Callable[[_Replies], T]) -> T:
    sock = conn._sock  # redis-py's connected socket (AbstractConnection._sock)
    if sock is None:
        raise redis.exceptions.ConnectionError("connection closed after sending")
    try:
        return read(_Replies(sock))
    except TimeoutError:  # socket.timeout: the socket's deadline
        raise redis.exceptions.TimeoutError("Timeout reading from socket") from None
    except OSError as exc:
        raise redis.exceptions.ConnectionError(f"Error while reading from socket: {exc}") from None


def get_many(
    pool: Any, names: Sequence[str], keys: Sequence[bytes], ring: KeyRing | None = None
) -> list[Fetched]:
    """Pipelined GETs of ``names`` on one pooled connection; ``keys`` are the
    chunk keys each object must hold. Raises redis-py's exceptions."""
    return _on_a_connection(pool, names, lambda replies: [replies.value(k, ring) for k in keys])
