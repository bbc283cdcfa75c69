"""The Valkey (Redis-protocol) shared tier: one server or a Valkey Cluster.

Persisted state, per chunk, one string value::

    key   = shared.valkey.key_prefix + key_hex(chunk key)   e.g. "kvstrata:3f0a…"
    value = objformat object, version 3 (header + payload + checksum trailer,
            codec from shared.codec); version-2 values are read too
    TTL   = shared.valkey.ttl_seconds when set, else none; a tenant's
            ttl_seconds when shorter (per-key expiry, SET ... PX)

A tenant with ``budgets.shared_bytes`` also has a ledger of its objects
on the server (two keys under the same prefix, shape and rules in
:mod:`.valkey_ledger`), reserved before each ``SET NX``.

Values are written with ``SET NX``: the first writer of a chunk wins and
later writers count ``deduplicated_total`` (equal keys mean equal bytes).
A value that fails validation is counted in ``corrupt_total``, deleted and
answered as a miss.

The client (redis-py + hiredis with our own command packer, which sends a
value's buffers unjoined) is built in :mod:`.valkey_client`, which says why.

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
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import redis.exceptions

from kvstrata.sidecar.config import SharedConfig
from kvstrata.sidecar.keys import ChunkKey, key_hex
from kvstrata.sidecar.objformat import ChunkMeta, StreamedObject
from kvstrata.sidecar.tiers import valkey_get
from kvstrata.sidecar.tiers.base import Place, TierStats
from kvstrata.sidecar.tiers.remote import Encoder, Fetched, RemoteTier, Stored
from kvstrata.sidecar.tiers.stats import ValkeyStats
from kvstrata.sidecar.tiers.tenant_shares import TenantFigures
from kvstrata.sidecar.tiers.valkey_client import Scatter, connection_kwargs, make_client
from kvstrata.sidecar.tiers.valkey_ledger import (
    HELD,
    REFUSED,
    RESERVED,
    UNBUDGETED,
    NotStored,
    SharedBudgets,
)

if TYPE_CHECKING:
    from kvstrata.sidecar.sealing import KeyRing

logger = logging.getLogger(__name__)

_SCAN_BATCH = 500


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
        tenant_budgets: Mapping[str, int] | None = None,
    ) -> None:
        """``tenant_budgets``: a tenant's ``budgets.shared_bytes``, kept in the
        server's ledger (:mod:`.valkey_ledger`); each needs an expiry."""
        self._config = config.valkey
        super().__init__(config, self._config.timeout_seconds, tenant_ttl_seconds, keys)
        self._prefix = self._config.key_prefix
        self._budgets = SharedBudgets(self._prefix, tenant_budgets or {})
        self._budget_usage: dict[str, int] = {}  # what the ledgers counted at the last scrape
        for tenant in self._budgets.budgets:
            if self._expiry_ms(self._tenant_ttl.get(tenant)) is None:
                raise ValueError(
                    f"tenant {tenant!r}: budgets.shared_bytes needs an expiry (its "
                    "ttl_seconds or shared.valkey.ttl_seconds)"
                )
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
        self,
        names: Sequence[str],
        objects: Sequence[Encoder],
        ttls: Sequence[float | None],
        tenants: Sequence[str],
    ) -> list[Stored]:
        """Pipelined ``SET NX`` of each object, header, payload pieces and trailer
        sent unjoined; each payload piece is hashed just before it is sent.

        A budgeted tenant's objects are reserved in its ledger first
        (:mod:`.valkey_ledger`): one refused is not sent, one another writer
        holds is only asked about (EXISTS), and a reservation whose SET did
        not store is given back."""
        encoded = [make() for make in objects]  # one pipeline sends them all at once
        expiry = [self._expiry_ms(ttl) for ttl in ttls]
        admitted = [UNBUDGETED] * len(names)
        outcomes: list[Stored]
        try:
            client = self._client("io")
            if self._budgets:
                sizes = [len(obj) for obj in encoded]
                admitted = self._budgets.reserve(client, tenants, names, sizes, expiry)
            outcomes = self._send(client, names, encoded, expiry, admitted)
        except Exception as exc:
            self._failed("put", exc)
            outcomes = [exc] * len(names)
        else:
            self._breaker.record_success()
        finally:
            # Sent (or the connection dropped mid-send): nothing reads them again.
            for obj in encoded:
                obj.release()
        self._give_back(tenants, names, admitted, outcomes)
        return outcomes

    @staticmethod
    def _send(
        client: Any,
        names: Sequence[str],
        encoded: Sequence[StreamedObject],
        expiry: Sequence[int | None],
        admitted: Sequence[int],
    ) -> list[Stored]:
        """``SET NX`` of each object its ledger admitted (or that has none),
        ``EXISTS`` of each another writer holds, nothing for one refused."""
        outcomes: list[Stored] = [
            NotStored("budget") if answer == REFUSED else False for answer in admitted
        ]
        sent = [i for i, answer in enumerate(admitted) if answer != REFUSED]
        if not sent:
            return outcomes
        if len(sent) == 1 and admitted[sent[0]] != HELD:  # the common case: no pipeline
            i = sent[0]
            replies = [client.set(names[i], Scatter(encoded[i]), nx=True, px=expiry[i])]
        else:
            pipe = client.pipeline(transaction=False)
            for i in sent:
                if admitted[i] == HELD:
                    pipe.exists(names[i])
                else:
                    pipe.set(names[i], Scatter(encoded[i]), nx=True, px=expiry[i])
            replies = pipe.execute(raise_on_error=True)
        for i, reply in zip(sent, replies, strict=True):
            if admitted[i] == HELD:  # there: another writer stored it; else still on its way
                outcomes[i] = False if reply else NotStored("held")
            else:  # SET NX answers None when another writer stored the chunk first
                outcomes[i] = bool(reply)
        return outcomes

    def _give_back(
        self,
        tenants: Sequence[str],
        names: Sequence[str],
        admitted: Sequence[int],
        outcomes: Sequence[Stored],
    ) -> None:
        """End the ledger reservations of the objects that were not stored."""
        back = [
            i for i, answer in enumerate(admitted) if answer == RESERVED and outcomes[i] is not True
        ]
        if not back:
            return
        try:
            self._budgets.give_back(
                self._client("io"), [tenants[i] for i in back], [names[i] for i in back]
            )
        except Exception as exc:  # counted until they expire: refused early, never over
            self._failed("budget give-back", exc)
        else:
            self._breaker.record_success()

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

    def tenant_figures(self) -> TenantFigures | None:
        """Stores refused for a tenant's shared budget and the bytes its ledger
        counts (None: no budgets here). The ledgers are read at each scrape on
        the lookup client's short deadline; an unanswered read keeps the last
        figures, and an open breaker skips it."""
        if not self._budgets:
            return None
        if self._breaker.state == "closed":
            try:
                self._budget_usage = self._budgets.usage(self._client("lookup"))
            except Exception as exc:  # a scrape must not fail, nor count as a tier failure
                logger.debug("valkey budget ledger read failed: %s", exc)
        return self._budgets.figures(self._budget_usage)

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
