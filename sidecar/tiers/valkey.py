"""The Valkey (Redis-protocol) shared tier: one server or a Valkey Cluster.

Persisted state, per chunk, one string value::

    key   = shared.valkey.key_prefix + key_hex(chunk key)   e.g. "kvstrata:3f0a…"
    value = objformat object, version 3 (header + payload + checksum trailer,
            codec from shared.codec); version-2 values are read too
    TTL   = shared.valkey.ttl_seconds when set, else none; a tenant's
            ttl_seconds when shorter (per-key expiry, SET ... PX)

Values are written with ``SET NX``: the first writer of a chunk wins and
later writers count ``deduplicated_total`` (equal keys mean equal bytes).
A value that fails validation is counted in ``corrupt_total``, deleted and
answered as a miss.

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

Deadlines: every socket has ``timeout_seconds`` (``lookup_timeout_seconds``
for the EXISTS pipeline of :meth:`ValkeyTier.contains_many`); a dropped
connection is retried once at once on a fresh connection (stale pooled
sockets after a server restart), never on a timeout. Consecutive failures
open the :class:`CircuitBreaker`; while it is open every call answers
miss / False without touching the network. Error replies from a server
that answers (``OOM`` when ``maxmemory`` is reached under ``noeviction``)
are counted (``errors_total["full"]``) but do not open the breaker: reads
still work. A cache server should run with ``maxmemory-policy allkeys-lru``.

Evictions: the server evicts, not the tier, so :meth:`ValkeyTier.stats`
reads ``evicted_keys`` from ``INFO stats`` (summed over a cluster's nodes)
at each scrape, on the lookup client's short deadline; a server that does
not answer keeps the last value, and an open breaker skips the call.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import redis
import redis.cluster
import redis.connection
import redis.exceptions
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvstrata.sidecar.config import SharedConfig, ValkeyConfig
from kvstrata.sidecar.keys import ChunkKey, key_hex
from kvstrata.sidecar.objformat import ChunkMeta, StreamedObject
from kvstrata.sidecar.tiers import valkey_get
from kvstrata.sidecar.tiers.base import Place, TierStats
from kvstrata.sidecar.tiers.remote import Encoder, Fetched, RemoteTier, Stored, read_secret
from kvstrata.sidecar.tiers.stats import ValkeyStats

if TYPE_CHECKING:
    from kvstrata.sidecar.sealing import KeyRing

logger = logging.getLogger(__name__)

_CRLF = b"\r\n"
_SCAN_BATCH = 500


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


def _error_kind(exc: BaseException) -> str:
    if isinstance(exc, redis.exceptions.TimeoutError):
        return "timeout"
    if isinstance(exc, redis.exceptions.AuthenticationError | redis.exceptions.NoPermissionError):
        return "auth"
    if isinstance(exc, redis.exceptions.ConnectionError):
        return "connection"
    if isinstance(exc, redis.exceptions.RedisClusterException | redis.exceptions.ClusterError):
        return "cluster"
    if isinstance(exc, redis.exceptions.OutOfMemoryError):
        return "full"
    if isinstance(exc, redis.exceptions.ResponseError):
        return "server"
    return "client"


# Errors that are answers from a healthy server (a write refused because
# maxmemory is reached, an unexpected reply): counted, but they must not
# open the breaker and cut off reads that still work.
_ANSWERED = frozenset({"full", "server"})


class ValkeyTier(RemoteTier):
    """Chunk objects in Valkey / Redis, standalone or cluster (module docstring)."""

    name = "valkey"
    expires_per_key = True  # SET ... PX

    def __init__(
        self,
        config: SharedConfig,
        tenant_ttl_seconds: Mapping[str, float] | None = None,
        keys: KeyRing | None = None,
    ) -> None:
        self._config = config.valkey
        super().__init__(config, self._config.timeout_seconds, tenant_ttl_seconds, keys)
        self._prefix = self._config.key_prefix
        # Building a cluster client blocks on the network: not under the stats lock.
        self._client_lock = threading.Lock()
        self._clients: dict[str, Any] = {}
        connection_kwargs(self._config, 1.0)  # refuse a bad URL or secret file now, not later
        self._server_evicted: int | None = None

    # -- plumbing ---------------------------------------------------------

    def _client(self, purpose: str) -> Any:
        """The client for "io" or "lookup" (shorter deadline), built on first use."""
        client = self._clients.get(purpose)
        if client is None:
            with self._client_lock:
                client = self._clients.get(purpose)
                if client is None:
                    if purpose == "lookup":
                        timeout, pool = self._lookup_timeout, min(4, self._config.pool_size)
                    else:
                        timeout, pool = self._config.timeout_seconds, self._config.pool_size
                    client = make_client(self._config, timeout, pool)
                    self._clients[purpose] = client
        return client

    def _failed(self, op: str, exc: BaseException) -> None:
        kind = _error_kind(exc)
        logger.debug("valkey %s failed (%s): %s", op, kind, exc)
        self._count_error(kind)
        if kind in _ANSWERED:
            self._breaker.record_success()
        else:
            self._breaker.record_failure()

    def _name(self, key: ChunkKey) -> str:
        return self._prefix + key_hex(key)

    def _ping(self) -> None:
        self._client("io").ping()

    # -- RemoteTier hooks ---------------------------------------------------

    def _exists(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """One pipeline of EXISTS on the lookup client (shorter deadline)."""
        try:
            pipe = self._client("lookup").pipeline(transaction=False)
            for key in keys:
                pipe.exists(self._name(key))
            answers = pipe.execute(raise_on_error=True)
        except Exception as exc:  # any failure is "not known to be there"
            self._failed("contains_many", exc)
            return [False] * len(keys)
        self._breaker.record_success()
        return [bool(a) for a in answers]

    def _fetch(self, keys: Sequence[ChunkKey], names: Sequence[str]) -> list[Fetched]:
        """Pipelined GETs (one round trip; per node in cluster mode). A standalone
        server's replies are read by :mod:`.valkey_get`: one copy per value, each
        payload hashed while the rest arrives."""
        try:
            client = self._client("io")
            if not self._config.cluster:
                blobs = valkey_get.get_many(
                    client.connection_pool, names, [bytes(k) for k in keys], self._keys
                )
            elif len(names) == 1:
                blobs = [client.get(names[0])]
            else:
                pipe = client.pipeline(transaction=False)
                for name in names:
                    pipe.get(name)
                blobs = pipe.execute(raise_on_error=True)
        except Exception as exc:
            self._failed("get", exc)
            return [None] * len(names)
        self._breaker.record_success()
        return blobs

    def get_into(self, key: ChunkKey, place: Place) -> ChunkMeta | None:
        """A standalone server's reply is received straight into what ``place``
        names (:func:`.valkey_get.get_into`); a cluster's goes through ``get``."""
        if self._config.cluster:
            return super().get_into(key, place)
        if not self._allow():
            self._count(misses=1)
            return None
        name = self._name(key)
        try:
            got = valkey_get.get_into(
                self._client("io").connection_pool, name, bytes(key), place, self._keys
            )
        except Exception as exc:
            self._failed("get", exc)
            self._count(misses=1)
            return None
        self._breaker.record_success()
        if got is None:
            self._count(misses=1)
            return None
        if got.seal_failure:
            self._refuse_sealed(name, got.seal_failure)
            return None
        if got.corrupt:
            self._drop_corrupt(name, "checksum, key or length")
            return None
        self._count_hit(got.nbytes)
        return got.meta

    def _store_many(
        self, names: Sequence[str], objects: Sequence[Encoder], ttls: Sequence[float | None]
    ) -> list[Stored]:
        """Pipelined ``SET NX`` of each object, header, payload pieces and trailer
        sent unjoined; each payload piece is hashed just before it is sent."""
        encoded = [make() for make in objects]  # one pipeline sends them all at once
        expiry = [self._expiry_ms(ttl) for ttl in ttls]
        try:
            client = self._client("io")
            if len(names) == 1:
                answers = [client.set(names[0], Scatter(encoded[0]), nx=True, px=expiry[0])]
            else:
                pipe = client.pipeline(transaction=False)
                for name, parts, px in zip(names, encoded, expiry, strict=True):
                    pipe.set(name, Scatter(parts), nx=True, px=px)
                answers = pipe.execute(raise_on_error=True)
        except Exception as exc:
            self._failed("put", exc)
            return [exc] * len(names)
        finally:
            # Sent (or the connection dropped mid-send): nothing reads them again.
            for obj in encoded:
                obj.release()
        self._breaker.record_success()
        # SET NX answers None when another writer stored the chunk first.
        return [bool(a) for a in answers]

    def _expiry_ms(self, tenant_ttl: float | None) -> int | None:
        """PX of one value: the shorter of the tier's TTL and its tenant's."""
        ttls = [t for t in (self._config.ttl_seconds, tenant_ttl) if t is not None]
        return max(1, int(min(ttls) * 1000)) if ttls else None

    def _clear(self) -> None:
        """Delete every key under ``key_prefix`` (SCAN + UNLINK, all cluster nodes)."""
        try:
            client = self._client("io")
            batch: list[str] = []
            for name in client.scan_iter(match=self._prefix + "*", count=_SCAN_BATCH):
                batch.append(name)
                if len(batch) >= _SCAN_BATCH:
                    self._unlink(client, batch)
                    batch = []
            self._unlink(client, batch)
        except Exception as exc:
            self._failed("clear", exc)
            return
        self._breaker.record_success()

    def close(self) -> None:
        with self._client_lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            try:
                client.close()
            except Exception:  # closing a dead connection may fail; nothing to keep
                logger.debug("closing valkey client failed", exc_info=True)

    def stats(self) -> TierStats:
        snap = super().stats()
        if self._breaker.state == "closed":
            self._server_evicted = self._read_evicted_keys(self._server_evicted)
        snap.backend = ValkeyStats(server_evicted_keys=self._server_evicted)
        return snap

    def _read_evicted_keys(self, last: int | None) -> int | None:
        """``evicted_keys`` of INFO stats (every node's, summed); ``last`` when unanswered."""
        try:
            info = self._client("lookup").info("stats")
        except Exception as exc:  # a scrape must not fail, nor count as a tier failure
            logger.debug("valkey INFO stats failed: %s", exc)
            return last
        if "evicted_keys" in info:
            return int(info["evicted_keys"])
        # A cluster client answers one INFO per node, keyed by node.
        per_node = [v["evicted_keys"] for v in info.values() if isinstance(v, dict)]
        return sum(int(n) for n in per_node if n is not None) if per_node else last

    # -- helpers ----------------------------------------------------------

    def _delete(self, name: str) -> None:
        try:
            self._client("io").delete(name)
        except Exception as exc:
            self._failed("delete", exc)
        else:
            self._breaker.record_success()

    def _delete_many(self, names: Sequence[str]) -> None:
        try:
            self._unlink(self._client("io"), list(names))
        except Exception as exc:
            self._failed("delete", exc)
        else:
            self._breaker.record_success()

    @staticmethod
    def _unlink(client: Any, names: list[str | bytes]) -> None:
        if not names:
            return
        pipe = client.pipeline(transaction=False)
        for name in names:  # one key per command: cluster keys live in different slots
            pipe.unlink(name)
        pipe.execute()
