"""The S3 shared tier (AWS S3, MinIO, Ceph RGW, moto: any endpoint URL).

Persisted state, per chunk, one object::

    s3://{shared.s3.bucket}/{shared.s3.prefix}{key_hex(chunk key)}
    body = objformat object, version 3 (header + payload + checksum trailer,
           codec from shared.codec); version-2 objects are read too

Objects are never overwritten: a conditional PUT (``If-None-Match: *``),
or a HEAD before a multipart upload, skips chunks another writer already
stored (``deduplicated_total``). Bodies above
``multipart_threshold_bytes`` go up as concurrent parts of
``multipart_chunk_bytes`` through boto3's transfer manager; reads are one
GET per object, many objects at once (:meth:`S3Tier.get_many`).

Deadlines: each HTTP attempt has connect/read timeouts of
``timeout_seconds``, botocore retries at most ``max_attempts`` times, and
every operation runs on a worker pool of ``max_concurrency`` threads whose
result the caller waits for at most ``timeout_seconds`` (the wall-clock
deadline: a stalled endpoint costs one deadline, then a miss). Lookups
send their requests concurrently and answer False for any key not answered
within ``lookup_timeout_seconds``: HEADs, or, when the caller fetches what
it finds next (:meth:`S3Tier.contains_many_ahead`), GETs whose unread
responses the fetches take over (:mod:`.s3ahead`), one request per chunk.
Consecutive failures open the same :class:`CircuitBreaker` as the Valkey tier.

Bounded storage: the operator applies an expiry (a bucket lifecycle rule on
the prefix) and a size cap (its sweeper deletes the least recently modified
objects); with ``refresh_after_seconds`` set, reads keep the objects they
touch young (:mod:`.s3refresh`). A chunk that supersedes partial chunks
deletes them here once it is written (:meth:`S3Tier.remove_many`, one
DeleteObjects call).

This module decides when to call S3; its parts: the client, the bucket-level
calls and the error kinds (:mod:`.s3client`), uploads (:mod:`.s3upload`),
the objects' expiry and refresh (:mod:`.s3ages`), a lookup's held GETs
(:mod:`.s3ahead`) and a body read into buffers (:mod:`.s3body`).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from boto3.s3.transfer import TransferConfig

from kvstrata.sidecar.config import SharedConfig
from kvstrata.sidecar.keys import ChunkKey, key_hex
from kvstrata.sidecar.objformat import ChunkMeta, StreamedObject

if TYPE_CHECKING:
    from kvstrata.sidecar.sealing import KeyRing
from kvstrata.sidecar.tiers.base import Place, TierStats
from kvstrata.sidecar.tiers.placing import Placed, receive_into, receive_whole
from kvstrata.sidecar.tiers.remote import (
    Encoder,
    Fetched,
    RemoteTier,
    Stored,
)
from kvstrata.sidecar.tiers.s3ages import ObjectAges
from kvstrata.sidecar.tiers.s3ahead import HeldGets
from kvstrata.sidecar.tiers.s3body import BodyStream
from kvstrata.sidecar.tiers.s3client import (
    DeadlineExceeded,
    Missing,
    close_late,
    delete_keys,
    delete_prefix,
    ensure_bucket,
    error_code,
    error_kind,
    is_missing,
    lookup_threads,
    make_client,
)
from kvstrata.sidecar.tiers.s3expiry import expiry_metadata
from kvstrata.sidecar.tiers.s3upload import upload
from kvstrata.sidecar.tiers.stats import S3Stats

logger = logging.getLogger(__name__)

T = TypeVar("T")

T = TypeVar("T")


class S3Tier(RemoteTier):
    """Chunk objects in an S3 bucket under a prefix (module docstring)."""

    name = "s3"

    # A tenant's TTL is written into each object and checked on every read
    # (tiers.s3expiry); the bucket's lifecycle rule is the backstop.
    expires_per_key = True

    def __init__(
        self,
        config: SharedConfig,
        keys: KeyRing | None = None,
        tenant_ttl_seconds: Mapping[str, float] | None = None,
    ) -> None:
        self._config = config.s3
        super().__init__(config, self._config.timeout_seconds, tenant_ttl_seconds, keys=keys)
        self._client = make_client(self._config)
        self._transfer = TransferConfig(
            multipart_threshold=max(self._config.multipart_threshold_bytes, 5 << 20),
            multipart_chunksize=max(self._config.multipart_chunk_bytes, 5 << 20),
            max_concurrency=self._config.max_concurrency,
        )
        self._pool = cf.ThreadPoolExecutor(
            max_workers=self._config.max_concurrency, thread_name_prefix="kvstrata-s3"
        )
        # Lookups have their own threads so a burst of large transfers never
        # makes a prefix lookup wait behind them.
        self._lookups = cf.ThreadPoolExecutor(
            max_workers=lookup_threads(self._config), thread_name_prefix="kvstrata-s3-lookup"
        )
        # GET responses a lookup opened, for the fetches that follow it: one per
        # lookup thread at most, the share of the connection pool lookups have.
        self._held = HeldGets(lookup_threads(self._config), self._config.timeout_seconds)
        # Expiry by a tenant's TTL, and refreshes of what is read (.s3ages).
        self._ages = ObjectAges(self._client, self._config, self._pool.submit, self._count_error)
        self._bucket_ready = not self._config.create_bucket
        if self._config.create_bucket:
            self._ensure_bucket_guarded()

    # -- plumbing ---------------------------------------------------------

    def _name(self, key: ChunkKey) -> str:
        return self._config.prefix + key_hex(key)

    def _ping(self) -> None:
        self._call("head_bucket", lambda: self._client.head_bucket(Bucket=self._config.bucket))

    def _run_many(self, op: str, fns: Sequence[Callable[[], T]]) -> list[T | BaseException]:
        """Run each ``fn`` on the pool; wait for all at most ``timeout_seconds``.

        Each slot holds the result, a :class:`.s3client.Missing` (a 404: a plain miss)
        or the exception. Failures are counted by kind; the batch feeds the
        breaker once (a failure if any call failed).
        """
        futures = [self._pool.submit(fn) for fn in fns]
        done, _ = cf.wait(futures, timeout=self._config.timeout_seconds)
        out: list[T | BaseException] = []
        failed: list[BaseException] = []
        for future in futures:
            if future not in done:
                future.cancel()  # frees the slot if it never started; else its socket times out
                exc: BaseException = DeadlineExceeded(
                    f"{op} exceeded {self._config.timeout_seconds}s"
                )
                failed.append(exc)
            else:
                exc = future.exception()
                if exc is None:
                    out.append(future.result())
                    continue
                if is_missing(exc):
                    exc = Missing(op)
                else:
                    failed.append(exc)
            out.append(exc)
        if failed:
            self._failed(op, failed)
        else:
            self._breaker.record_success()
        return out

    def _call(self, op: str, fn: Callable[[], T]) -> T:
        """One call through :meth:`_run_many`; raises what it failed with."""
        result = self._run_many(op, [fn])[0]
        if isinstance(result, BaseException):
            raise result
        return result

    def _allow(self) -> bool:
        """The breaker allows the call and the bucket exists (made again if need be)."""
        if not super()._allow():
            return False
        if not self._bucket_ready:
            return self._ensure_bucket_guarded()
        return True

    def _failed(self, op: str, excs: Sequence[BaseException]) -> None:
        """Count each failure by kind; the breaker sees one failed call."""
        logger.debug("s3 %s failed %d time(s), first: %s", op, len(excs), excs[0])
        with self._lock:
            for exc in excs:
                self._stats.count_error(error_kind(exc))
        if self._config.create_bucket and any(error_code(e) == "NoSuchBucket" for e in excs):
            self._bucket_ready = False  # deleted (or a fresh endpoint): make it again
        self._breaker.record_failure()

    def _ensure_bucket_guarded(self) -> bool:
        """Create the bucket if missing; False (counted) when the endpoint fails."""
        try:
            config = self._config
            self._call(
                "create_bucket", lambda: ensure_bucket(self._client, config.bucket, config.region)
            )
        except Exception:
            return False
        self._bucket_ready = True
        return True

    # -- RemoteTier hooks ---------------------------------------------------

    def _exists(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Concurrent HEADs; a key not answered within the lookup deadline is False."""
        bucket = self._config.bucket
        futures = [
            self._lookups.submit(self._client.head_object, Bucket=bucket, Key=self._name(k))
            for k in keys
        ]
        return self._answers(keys, futures)

    def _exists_ahead(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """GETs instead of HEADs for the keys there is room to hold (see
        :mod:`.s3ahead`): each answers from its status line and its response
        is held for the fetch that follows. Keys already held are present
        without a request; responses after the first missing key are closed
        (the prefix walk stops there: nobody will fetch them)."""
        bucket = self._config.bucket
        names = [self._name(k) for k in keys]
        room = self._held.room()
        futures: list[cf.Future[Any] | None] = []
        gets: set[int] = set()
        for i, name in enumerate(names):
            if self._held.holds(name):
                futures.append(None)
            elif len(gets) < room:
                gets.add(i)
                futures.append(self._lookups.submit(self._open_get, name))
            else:
                head = self._lookups.submit(self._client.head_object, Bucket=bucket, Key=name)
                futures.append(head)
        answers = self._answers(keys, futures)
        wanted = next((i for i, there in enumerate(answers) if not there), len(answers))
        for i, (name, future) in enumerate(zip(names, futures, strict=True)):
            if future is None and i > wanted:
                self._held.drop(name)
            elif i in gets and i < wanted:  # answered in time, so done and found
                self._held.hold(name, future.result())
            elif i in gets:  # missing, too late or not wanted: closed once it answers
                future.add_done_callback(self._close_opened)
        return answers

    def _close_opened(self, future: cf.Future[Any]) -> None:
        """Close a lookup's GET response nobody will read (a done-callback)."""
        if not future.cancelled() and future.exception() is None:
            self._held.discard(future.result())

    def _open_get(self, name: str) -> dict[str, Any]:
        """A GET whose body is left unread (held by :meth:`_exists_ahead`)."""
        return self._client.get_object(Bucket=self._config.bucket, Key=name)

    def _answers(
        self, keys: Sequence[ChunkKey], futures: Sequence[cf.Future[Any] | None]
    ) -> list[bool]:
        """Wait for the lookup's requests (None: known present) until the lookup
        deadline; whether each key is there. Failures feed the breaker once."""
        started = [f for f in futures if f is not None]
        done, pending = cf.wait(started, timeout=self._lookup_timeout)
        for future in pending:
            future.cancel()
        answers: list[bool] = []
        failure: BaseException | None = None
        for key, future in zip(keys, futures, strict=True):
            if future is None:
                answers.append(True)
                continue
            if future not in done:
                answers.append(False)
                continue
            exc = future.exception()
            if exc is not None and not is_missing(exc):
                failure = exc
            if exc is None and self._ages.past_ttl(self._name(key), future.result()):
                answers.append(False)
                continue
            answers.append(exc is None)
            if exc is None:  # a lookup is a read too: what vLLM asks for stays young
                self._ages.read(self._name(key), future.result())
        # A slow but answering endpoint is not a failure; silence is.
        if failure is not None or (pending and not done):
            self._failed("contains_many", [failure or DeadlineExceeded("lookup deadline")])
        else:
            self._breaker.record_success()
        return answers

    def _fetch(self, keys: Sequence[ChunkKey], names: Sequence[str]) -> list[Fetched]:
        """Concurrent GETs on the pool, all within one ``timeout_seconds`` deadline."""
        return self._run_many(
            "get",
            [
                lambda k=k, n=n: self._download(n, bytes(k))
                for k, n in zip(keys, names, strict=True)
            ],
        )

    def _store_many(
        self,
        names: Sequence[str],
        objects: Sequence[Encoder],
        ttls: Sequence[float | None],
        tenants: Sequence[str],
    ) -> list[Stored]:
        """Concurrent uploads, each skipped when the object already exists; each object is
        encoded on its upload's thread and hashed as its body is read. ``ttls[i]``: object
        i's expiry, written into it (tiers.s3expiry). No budgets here (config refuses them)."""
        fns = [
            lambda n=n, e=e, t=t: self._store(n, e(), expiry_metadata(t))
            for n, e, t in zip(names, objects, ttls, strict=True)
        ]
        return self._run_many("put", fns)

    def _delete_many(self, names: Sequence[str]) -> None:
        """One DeleteObjects call per 1000 names; absent objects are fine."""
        bucket = self._config.bucket
        try:
            self._call("delete", lambda: delete_keys(self._client, bucket, names))
        except Exception:  # counted by _call
            return

    def _clear(self) -> None:
        """Delete every object under ``prefix`` (list + batched DeleteObjects)."""
        try:
            config = self._config
            self._call("clear", lambda: delete_prefix(self._client, config.bucket, config.prefix))
        except Exception:  # counted by _call
            return

    def stats(self) -> TierStats:
        snap = super().stats()
        ages = self._ages
        snap.backend = S3Stats(
            refreshed_total=ages.refreshed_total,
            refresh_dropped_total=ages.refresh_dropped_total,
            lookup_gets_used_total=self._held.taken_total,
            lookup_gets_closed_total=self._held.closed_unread_total,
            expired_total=ages.expired_total,
        )
        return snap

    def drain_refreshes(self, timeout: float) -> bool:
        """Wait until queued refreshes are done (tests, shutdown); True at once without any."""
        return self._ages.drain(timeout)

    def close(self) -> None:
        self._ages.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._lookups.shutdown(wait=False, cancel_futures=True)
        self._held.close_all()
        self._client.close()

    # -- transfers (run on the pool) ---------------------------------------

    def _store(
        self, object_key: str, obj: StreamedObject, metadata: dict[str, str] | None = None
    ) -> bool:
        """Upload unless the object exists (:func:`.s3upload.upload`; True if
        stored, False if it was there), then the object's pooled buffer goes back: here, on the
        upload's own thread, once the upload returned (never while a body
        read may still come, as from a caller that stopped waiting)."""
        try:
            return upload(
                self._client, self._config.bucket, object_key, obj, metadata, self._transfer
            )
        finally:
            obj.release()

    def get_into(self, key: ChunkKey, place: Place) -> ChunkMeta | None:
        """The payload is received straight into what ``place`` names (an L1
        slot; :mod:`.placing`, :mod:`.s3body`), from the response a lookup
        opened when one is held. On the calling thread, and never after this
        returns: a read left running on a pool thread past its deadline could
        still be writing into a slot the engine had given to another chunk.
        Bounded by ``timeout_seconds``: the request by the deadline itself
        (:meth:`_open_by`), the body between pieces, plus the client's read
        timeout on each piece."""
        if not self._allow():
            self._count(misses=1)
            return None
        name = self._name(key)
        try:
            placed = self._receive_into(name, bytes(key), place)
        except Exception as exc:
            if is_missing(exc):
                self._breaker.record_success()
            else:
                self._failed("get", [exc])
            self._count(misses=1)
            return None
        self._breaker.record_success()
        if placed.seal_failure:
            self._refuse_sealed(name, placed.seal_failure)
            return None
        if placed.corrupt:
            self._drop_corrupt(name, "checksum, key or length")
            return None
        if placed.meta is None:  # nowhere to put it
            self._count(misses=1)
            return None
        self._count_hit(placed.nbytes)
        return placed.meta

    def _receive_into(self, name: str, key: bytes, place: Place) -> Placed:
        """A held response is read when there is one; if its connection broke
        before anything was placed, the object is asked for again, once (a
        reserved destination is never placed twice)."""
        deadline = time.monotonic() + self._config.timeout_seconds
        placed_once = False

        def place_once(nbytes: int, meta: ChunkMeta) -> memoryview | None:
            nonlocal placed_once
            placed_once = True
            return place(nbytes, meta)

        response = self._held.take(name)
        if response is not None:
            try:
                return self._receive(name, response, key, place_once, deadline)
            except Exception as exc:
                if placed_once:
                    raise
                logger.debug("s3 held GET of %s failed (%s); sending it again", name, exc)
        return self._receive(name, self._open_by(name, deadline), key, place_once, deadline)

    def _open_by(self, name: str, deadline: float) -> dict[str, Any]:
        """A GET's response (headers in, body unread) by ``deadline``. The request
        runs on the pool, so a stalled endpoint costs the caller no more than
        the deadline; a response that comes later is closed unread."""
        future = self._pool.submit(self._open_get, name)
        try:
            return future.result(timeout=max(0.0, deadline - time.monotonic()))
        except cf.TimeoutError:
            if not future.cancel():
                future.add_done_callback(close_late)
            raise DeadlineExceeded(f"get exceeded {self._config.timeout_seconds}s") from None

    def _receive(
        self, name: str, response: dict[str, Any], key: bytes, place: Place, deadline: float
    ) -> Placed:
        if self._ages.past_ttl(name, response):  # a miss: nothing is placed
            return Placed(None, 0)
        body = BodyStream(response, deadline)
        try:
            placed = receive_into(body.size, key, place, body.fill, body.skip, self._keys)
        finally:
            body.finish()
        if placed.meta is not None:
            self._ages.read(name, response)
        return placed

    def _download(self, object_key: str, key: bytes) -> Fetched:
        """One plain GET, checked on this thread. Parallelism comes from fetching
        many chunks at once (:meth:`get_many`), which keeps every connection busy
        without the per-request overhead of ranged GETs on objects of a few MiB;
        checking each object here overlaps its checksum with the other GETs.
        The body is received into one buffer of its own, hashed as it arrives,
        and a sealed one is opened over itself (:func:`.placing.receive_whole`).
        A body that fails the check goes back as bytes: the caller counts and
        deletes it (never from a pool thread, which would wait on the pool)."""
        deadline = time.monotonic() + self._config.timeout_seconds
        response = self._held.take(object_key)
        if response is not None:
            try:
                return self._download_from(object_key, response, key, deadline)
            except Exception as exc:  # the held connection broke: ask again, once
                logger.debug("s3 held GET of %s failed (%s); sending it again", object_key, exc)
        response = self._client.get_object(Bucket=self._config.bucket, Key=object_key)
        return self._download_from(object_key, response, key, deadline)

    def _download_from(
        self, object_key: str, response: dict[str, Any], key: bytes, deadline: float
    ) -> Fetched:
        if self._ages.past_ttl(object_key, response):
            return None
        body = BodyStream(response, deadline)
        try:
            got = receive_whole(body.size, memoryview(b""), key, body.fill, self._keys)
        finally:
            body.finish()
        self._ages.read(object_key, response)
        return got

    # -- helpers ----------------------------------------------------------

    def _delete(self, object_key: str) -> None:
        try:
            self._call(
                "delete",
                lambda: self._client.delete_object(Bucket=self._config.bucket, Key=object_key),
            )
        except Exception:  # missing is fine; failures are counted by _call
            return
