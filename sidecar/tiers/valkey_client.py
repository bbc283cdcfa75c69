"""The redis-py client of the Valkey tier: our deadlines, and a command packer
that sends a value's buffers without joining them.

Why a module of its own: building and tuning the client is plumbing the
tier's cache logic (:mod:`.valkey`) does not need to see.

Client choice (measured on this project's 2-core build machine, loopback
redis-server 7.0, 16 x 4 MiB values, GB/s; EXISTS x256 pipelined in ms):

    client                       SET 1-by-1  GET 1-by-1  SET pipe  GET pipe  EXISTS
    redis-py 8.1 (pure Python)      1.43        0.37       1.66      0.38     1.8
    redis-py 8.1 + hiredis          0.56        1.53       0.79      0.71     1.4
    valkey-py 6.2 (pure Python)     1.43        0.45       1.31      0.38     2.1
    valkey-glide 2.6 (asyncio)      1.05        1.10       0.60      0.50     1.6

redis-py with the hiredis *parser* reads fastest, but hiredis' command
*packer* copies every value into one buffer, which halves SET. So we use
redis-py + hiredis with our own packer (:class:`_ScatterPacker`): it sends
the object header, the payload (in pieces, each hashed just before it is
sent) and the checksum trailer as separate buffers, so a value is never
joined or copied on its way to the socket. glide was slower here and has
no synchronous client in its base package; valkey-py is a fork of redis-py
without a faster path.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import redis
import redis.cluster
import redis.connection
import redis.exceptions
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvstrata.sidecar.config import ValkeyConfig
from kvstrata.sidecar.objformat import StreamedObject
from kvstrata.sidecar.tiers.remote import read_secret

__all__ = ["Scatter", "connection_kwargs", "make_client"]

_CRLF = b"\r\n"


class Scatter:
    """One RESP bulk string sent from several buffers without joining them.

    Built from buffers or from a :class:`StreamedObject`; a large value's
    buffers are drawn only while the command goes to the socket
    (:meth:`_ScatterSending.send_packed_command`), so a streamed object's
    payload is hashed piece by piece as it is sent.
    """

    __slots__ = ("_source", "length")

    def __init__(self, source: Sequence[bytes | memoryview] | StreamedObject) -> None:
        if isinstance(source, StreamedObject):
            self._source: StreamedObject | list[memoryview] = source
            self.length = len(source)
        else:
            self._source = [memoryview(p).cast("B") for p in source]
            self.length = sum(len(p) for p in self._source)

    def __len__(self) -> int:
        return self.length

    def pieces(self) -> Iterator[bytes | memoryview]:
        if isinstance(self._source, StreamedObject):
            return self._source.pieces()
        return iter(self._source)


class _ScatterPacker:
    """RESP command packer that keeps large and :class:`Scatter` args unjoined."""

    def __init__(self, buffer_cutoff: int, encode: Any) -> None:
        self._cutoff = buffer_cutoff
        self._encode = encode

    def pack(self, *args: Any) -> list[bytes | memoryview | Scatter]:
        if isinstance(args[0], str):  # "CLUSTER INFO" style multi-word commands
            args = tuple(args[0].encode().split()) + args[1:]
        elif b" " in args[0]:
            args = tuple(args[0].split()) + args[1:]
        out: list[bytes | memoryview | Scatter] = []
        head = b"*%d\r\n" % len(args)
        for arg in args:
            if isinstance(arg, Scatter):
                out.append(head + b"$%d\r\n" % arg.length)
                # A large value stays one item, expanded while it is sent; a
                # small one is joined (redis-py's pack_commands joins small
                # items, and only bytes can be joined).
                out.append(arg if arg.length > self._cutoff else b"".join(arg.pieces()))
                head = _CRLF
                continue
            data = self._encode(arg)
            if len(data) > self._cutoff or isinstance(data, memoryview):
                out.append(head + b"$%d\r\n" % len(data))
                out.append(data)
                head = _CRLF
            else:
                head = b"%s$%d\r\n%s\r\n" % (head, len(data), data)
        out.append(head)
        return out


# Buffers up to this size (RESP framing, the object header, the trailer) are
# joined with their neighbours rather than sent on their own: each send call
# costs a system call, and on a full socket buffer a wait and a wake-up, so a
# value goes out in as many calls as the raw client's (framing, payload,
# framing) plus one per extra payload piece.
_JOIN_BELOW = 4096


def _expanded(command: Iterable[Any]) -> Iterator[Any]:
    """A packed command's items with each :class:`Scatter` drawn piece by piece
    (so a streamed payload is hashed as it is sent) and small items joined."""
    pending: list[bytes | memoryview] = []
    for item in command:
        pieces = item.pieces() if isinstance(item, Scatter) else (item,)
        for piece in pieces:
            if len(piece) < _JOIN_BELOW:
                pending.append(piece)
                continue
            if pending:
                yield b"".join(pending)
                pending = []
            yield piece
    if pending:
        yield b"".join(pending)


class _ScatterSending:
    """Connection mixin: our packer, and :class:`Scatter` items expanded as sent.

    redis-py's ``send_packed_command`` sends each item with ``sendall`` in
    turn (redis/connection.py, ``AbstractConnection.send_packed_command``),
    so handing it a generator sends each piece as soon as it is drawn, with
    redis-py's own error handling around it.
    """

    _buffer_cutoff: int
    encoder: Any

    def _construct_command_packer(self, packer: Any) -> _ScatterPacker:
        return _ScatterPacker(self._buffer_cutoff, self.encoder.encode)

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        if not isinstance(command, str | bytes):
            command = _expanded(command)
        super().send_packed_command(command, check_health)  # type: ignore[misc]


class _ScatterConnection(_ScatterSending, redis.connection.Connection):
    pass


class _ScatterSSLConnection(_ScatterSending, redis.connection.SSLConnection):
    pass


def connection_kwargs(config: ValkeyConfig, timeout: float) -> dict[str, Any]:
    """Keyword arguments of a redis-py client for ``config`` with ``timeout`` deadlines."""
    try:
        kwargs: dict[str, Any] = redis.connection.parse_url(config.url)
    except ValueError as exc:
        raise ValueError(f"shared.valkey.url: {exc}") from None
    if "path" in kwargs:
        raise ValueError("shared.valkey.url: unix sockets are not supported; use redis://")
    tls = kwargs.pop("connection_class", None) is redis.connection.SSLConnection
    if config.cluster and kwargs.get("db", 0) != 0:
        raise ValueError("shared.valkey.url: a Valkey cluster has only database 0")
    if config.username:
        kwargs["username"] = config.username
    if config.password_file:
        kwargs["password"] = read_secret(config.password_file, "shared.valkey.password_file")
    kwargs.update(
        # RESP2, as redis-py before 8 spoke by default: no push messages (RESP3
        # maintenance notifications, tracking) can arrive between the replies
        # that valkey_get reads off the socket itself.
        protocol=2,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        # A broken connection is retried once, at once, on a new socket
        # (pooled sockets are stale after a restart); timeouts are not retried.
        retry=Retry(NoBackoff(), 1, supported_errors=(redis.exceptions.ConnectionError,)),
        connection_class=_ScatterSSLConnection if tls else _ScatterConnection,
    )
    if tls:
        kwargs["ssl_ca_certs"] = config.tls_ca_file
        if config.tls_insecure_skip_verify:
            kwargs.update(ssl_cert_reqs="none", ssl_check_hostname=False)
    return kwargs


def make_client(config: ValkeyConfig, timeout: float, pool_size: int) -> Any:
    """A redis-py client (``Redis`` or ``RedisCluster``) with our deadlines.

    ``RedisCluster`` connects at construction to learn the slot map, so this
    raises ``redis.exceptions.RedisError`` when no node answers.
    """
    kwargs = connection_kwargs(config, timeout)
    if config.cluster:
        kwargs.pop("retry")
        kwargs.pop("db", None)
        # A plain redis:// seed URL keeps our connection class (a rediss:// one
        # would make redis-py substitute its own); TLS comes from the class.
        seed = f"redis://{kwargs.pop('host')}:{kwargs.pop('port')}/0"
        return redis.cluster.RedisCluster(
            url=seed,
            max_connections=pool_size,
            retry=Retry(NoBackoff(), 1),  # MOVED/ASK are followed; one retry on topology change
            **kwargs,
        )
    pool = redis.BlockingConnectionPool(max_connections=pool_size, timeout=timeout, **kwargs)
    return redis.Redis(connection_pool=pool)
