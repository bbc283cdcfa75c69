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
"""

from __future__ import annotations

import concurrent.futures as cf
import datetime as dt
import io
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import boto3
import botocore.config
import botocore.exceptions
from boto3.s3.transfer import TransferConfig

from kvstrata.sidecar.config import S3Config, SharedConfig
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
    read_secret,
)
from kvstrata.sidecar.tiers.s3ahead import HeldGets, close_response
from kvstrata.sidecar.tiers.s3body import BodyStream
from kvstrata.sidecar.tiers.s3expiry import expired, expiry_metadata, has_expiry
from kvstrata.sidecar.tiers.s3refresh import Refresher
from kvstrata.sidecar.tiers.stats import S3Stats

logger = logging.getLogger(__name__)

T = TypeVar("T")
_DELETE_BATCH = 1000  # the most keys one DeleteObjects call takes
_MISSING_CODES = frozenset({"404", "NoSuchKey", "NotFound"})
# A conditional PUT refused because the object exists (or is being written).
_EXISTS_CODES = frozenset({"PreconditionFailed", "412", "ConditionalRequestConflict"})


class _Missing(Exception):
    """The object (or bucket) is not there: a plain miss, not a failure."""


class _DeadlineExceeded(Exception):
    """The operation did not finish within the tier's wall-clock deadline."""


def botocore_config(config: S3Config) -> botocore.config.Config:
    """The client settings the tier (and the benchmark's raw baseline) uses."""
    return botocore.config.Config(
        region_name=config.region,
        connect_timeout=config.timeout_seconds,
        read_timeout=config.timeout_seconds,
        retries={"max_attempts": config.max_attempts, "mode": "standard"},
        # Transfers, their multipart parts and the lookups' requests share one
        # pool; a lookup's GETs keep their connections while held (at most
        # lookup_threads of them, see S3Tier._held), so the transfers keep theirs.
        max_pool_connections=config.max_concurrency * 2 + lookup_threads(config),
        # Objects carry their own xxh3 checksums, verified on every read.
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )


def lookup_threads(config: S3Config) -> int:
    """A lookup's requests are small (HEADs, or GETs whose bodies it leaves for
    the fetches): a lookup sends many more at once than there are transfers."""
    return min(4 * config.max_concurrency, 64)


def make_client(config: S3Config) -> Any:
    """A boto3 S3 client: credentials from the mounted files, else boto3's chain."""
    credentials: dict[str, str] = {}
    if config.access_key_id_file or config.secret_access_key_file:
        if not (config.access_key_id_file and config.secret_access_key_file):
            raise ValueError(
                "shared.s3.access_key_id_file and shared.s3.secret_access_key_file "
                "must be set together"
            )
        credentials = {
            "aws_access_key_id": read_secret(
                config.access_key_id_file, "shared.s3.access_key_id_file"
            ),
            "aws_secret_access_key": read_secret(
                config.secret_access_key_file, "shared.s3.secret_access_key_file"
            ),
        }
    session = boto3.session.Session(**credentials)
    return session.client("s3", endpoint_url=config.endpoint_url, config=botocore_config(config))


def _error_kind(exc: BaseException) -> str:
    if isinstance(exc, _DeadlineExceeded):
        return "deadline"
    if isinstance(
        exc, botocore.exceptions.ConnectTimeoutError | botocore.exceptions.ReadTimeoutError
    ):
        return "timeout"
    if isinstance(
        exc, botocore.exceptions.EndpointConnectionError | botocore.exceptions.ConnectionClosedError
    ):
        return "connection"
    if isinstance(exc, botocore.exceptions.NoCredentialsError):
        return "auth"
    if isinstance(exc, botocore.exceptions.ClientError):
        code = _error_code(exc)
        return "auth" if code in ("AccessDenied", "403", "InvalidAccessKeyId") else "server"
    if isinstance(exc, botocore.exceptions.BotoCoreError):
        return "connection"
    # A body read straight off the socket (.s3body): its deadline or the
    # socket's timeout, or the connection ending early.
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, OSError):
        return "connection"
    return "client"


def _error_code(exc: BaseException) -> str:
    if isinstance(exc, botocore.exceptions.ClientError):
        return str(exc.response.get("Error", {}).get("Code", ""))
    return ""


def _is_missing(exc: BaseException) -> bool:
    return _error_code(exc) in _MISSING_CODES


def _close_late(future: cf.Future[Any]) -> None:
    """Close a GET response that came after its caller gave up (a done-callback)."""
    if not future.cancelled() and future.exception() is None:
        close_response(future.result())


def _modified(future: cf.Future[Any]) -> dt.datetime | None:
    """The LastModified of a finished HEAD's response."""
    return future.result().get("LastModified")


class _ObjectBody(io.RawIOBase):
    """A seekable read-only file over a :class:`StreamedObject`.

    ``read`` hands out slices of the object's own buffers, so a PUT body is
    never joined into one copy (that copy cost ~8% of throughput at 16 MiB),
    and the payload is hashed slice by slice as it is read, so the checksum
    costs no pass of its own before the upload (the trailer is computed
    when the reader reaches it). botocore seeks it back to 0 to sign it
    (over plain http) and to retry; a second read hashes nothing again.
    ``readinto`` serves the buffered reader the multipart uploader wraps it in.
    """

    def __init__(self, obj: StreamedObject) -> None:
        self._obj = obj
        self._size = len(obj)
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = min(max(base + offset, 0), self._size)
        return self._pos

    def read(self, size: int | None = -1) -> memoryview | bytes:  # type: ignore[override]
        """Up to ``size`` bytes from one part of the object (fewer at a part boundary)."""
        if size is None or size < 0:
            size = self._size - self._pos
        chunk = self._obj.read_at(self._pos, size)
        self._pos += len(chunk)
        return chunk

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        written = 0
        while written < len(out):
            chunk = self.read(len(out) - written)
            if not chunk:
                break
            out[written : written + len(chunk)] = chunk
            written += len(chunk)
        return written


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
        self._expired_total = 0  # objects read past their tenant's TTL (under _lock)
        self._refresher: Refresher | None = None
        if self._config.refresh_after_seconds is not None:
            self._refresher = Refresher(
                self._refresh,
                after_seconds=self._config.refresh_after_seconds,
                per_second=self._config.refresh_per_second,
                depth=self._config.refresh_queue_depth,
                on_error=self._refresh_failed,
            )
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

        Each slot holds the result, a :class:`_Missing` (a 404: a plain miss)
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
                exc: BaseException = _DeadlineExceeded(
                    f"{op} exceeded {self._config.timeout_seconds}s"
                )
                failed.append(exc)
            else:
                exc = future.exception()
                if exc is None:
                    out.append(future.result())
                    continue
                if _is_missing(exc):
                    exc = _Missing(op)
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
                self._stats.count_error(_error_kind(exc))
        if self._config.create_bucket and any(_error_code(e) == "NoSuchBucket" for e in excs):
            self._bucket_ready = False  # deleted (or a fresh endpoint): make it again
        self._breaker.record_failure()

    def _ensure_bucket_guarded(self) -> bool:
        """Create the bucket if missing; False (counted) when the endpoint fails."""
        try:
            self._call("create_bucket", self._ensure_bucket)
        except Exception:
            return False
        self._bucket_ready = True
        return True

    def _ensure_bucket(self) -> None:
        bucket = self._config.bucket
        try:
            self._client.head_bucket(Bucket=bucket)
            return
        except botocore.exceptions.ClientError as exc:
            if not _is_missing(exc):
                raise
        args: dict[str, Any] = {"Bucket": bucket}
        if self._config.region != "us-east-1":
            args["CreateBucketConfiguration"] = {"LocationConstraint": self._config.region}
        try:
            self._client.create_bucket(**args)
        except botocore.exceptions.ClientError as exc:
            code = exc.response.get("Error", {}).get("Code")
            if code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise
        logger.info("created S3 bucket %s", bucket)

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
            if exc is not None and not _is_missing(exc):
                failure = exc
            if exc is None and expired(future.result()):
                self._expire(self._name(key), future.result())
                answers.append(False)
                continue
            answers.append(exc is None)
            if exc is None and self._refresher is not None and not has_expiry(future.result()):
                # A lookup is a read too: what vLLM asks for stays young.
                self._refresher.offer(self._name(key), _modified(future))
        # A slow but answering endpoint is not a failure; silence is.
        if failure is not None or (pending and not done):
            self._failed("contains_many", [failure or _DeadlineExceeded("lookup deadline")])
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
        self, names: Sequence[str], objects: Sequence[Encoder], ttls: Sequence[float | None]
    ) -> list[Stored]:
        """Concurrent uploads, each skipped when the object already exists; each
        object is encoded (compressed) on its upload's thread and hashed as its
        body is read. ``ttls[i]``: object i's expiry, written into it
        (tiers.s3expiry)."""
        fns = [
            lambda n=n, e=e, t=t: self._store(n, e(), expiry_metadata(t))
            for n, e, t in zip(names, objects, ttls, strict=True)
        ]
        return self._run_many("put", fns)

    def _delete_many(self, names: Sequence[str]) -> None:
        """One DeleteObjects call per 1000 names; absent objects are fine."""
        bucket = self._config.bucket

        def delete() -> None:
            for i in range(0, len(names), _DELETE_BATCH):
                batch = [{"Key": n} for n in names[i : i + _DELETE_BATCH]]
                self._client.delete_objects(Bucket=bucket, Delete={"Objects": batch, "Quiet": True})

        try:
            self._call("delete", delete)
        except Exception:  # counted by _call
            return

    def _clear(self) -> None:
        """Delete every object under ``prefix`` (list + batched DeleteObjects)."""
        try:
            self._call("clear", self._clear_prefix)
        except Exception:  # counted by _call
            return

    def stats(self) -> TierStats:
        snap = super().stats()
        with self._lock:
            expired = self._expired_total
        refresher = self._refresher
        snap.backend = S3Stats(
            refreshed_total=refresher.refreshed_total if refresher is not None else 0,
            refresh_dropped_total=refresher.dropped_total if refresher is not None else 0,
            lookup_gets_used_total=self._held.taken_total,
            lookup_gets_closed_total=self._held.closed_unread_total,
            expired_total=expired,
        )
        return snap

    def drain_refreshes(self, timeout: float) -> bool:
        """Wait until queued refreshes are done (tests, shutdown); True at once without any."""
        return self._refresher is None or self._refresher.drain(timeout)

    def close(self) -> None:
        if self._refresher is not None:
            self._refresher.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._lookups.shutdown(wait=False, cancel_futures=True)
        self._held.close_all()
        self._client.close()

    # -- transfers (run on the pool) ---------------------------------------

    def _store(
        self, object_key: str, obj: StreamedObject, metadata: dict[str, str] | None = None
    ) -> bool:
        """:meth:`_upload`, then the object's pooled buffer goes back: here, on the
        upload's own thread, once the upload returned (never while a body
        read may still come, as from a caller that stopped waiting)."""
        try:
            return self._upload(object_key, obj, metadata)
        finally:
            obj.release()

    def _upload(
        self, object_key: str, obj: StreamedObject, metadata: dict[str, str] | None
    ) -> bool:
        """Upload unless the object exists; True if stored, False if it was there.

        Small objects use a conditional PUT (``If-None-Match: *``): one
        request, atomic against a concurrent writer, and with botocore's
        ``Expect: 100-continue`` (bodies over 1 MB) the body is not sent when
        refused. Multipart
        uploads cannot be conditional through boto3's transfer manager, so
        large objects are checked with a HEAD first.
        """
        size = len(obj)
        bucket = self._config.bucket
        if size < self._transfer.multipart_threshold:
            try:
                self._client.put_object(
                    Bucket=bucket,
                    Key=object_key,
                    Body=_ObjectBody(obj),
                    IfNoneMatch="*",
                    Metadata=metadata or {},
                )
            except botocore.exceptions.ClientError as exc:
                if _error_code(exc) in _EXISTS_CODES:
                    return False
                raise
            return True
        try:
            self._client.head_object(Bucket=bucket, Key=object_key)
            return False
        except botocore.exceptions.ClientError as exc:
            if not _is_missing(exc):
                raise
        self._client.upload_fileobj(
            io.BufferedReader(_ObjectBody(obj), buffer_size=1 << 20),
            bucket,
            object_key,
            ExtraArgs={"Metadata": metadata} if metadata else None,
            Config=self._transfer,
        )
        return True

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
            if _is_missing(exc):
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
                future.add_done_callback(_close_late)
            raise _DeadlineExceeded(f"get exceeded {self._config.timeout_seconds}s") from None

    def _receive(
        self, name: str, response: dict[str, Any], key: bytes, place: Place, deadline: float
    ) -> Placed:
        if expired(response):  # a miss: nothing is placed
            self._expire(name, response)
            return Placed(None, 0)
        body = BodyStream(response, deadline)
        try:
            placed = receive_into(body.size, key, place, body.fill, body.skip, self._keys)
        finally:
            body.finish()
        if placed.meta is not None and self._refresher is not None and not has_expiry(response):
            self._refresher.offer(name, response.get("LastModified"))
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
        if expired(response):
            self._expire(object_key, response)
            return None
        body = BodyStream(response, deadline)
        try:
            got = receive_whole(body.size, memoryview(b""), key, body.fill, self._keys)
        finally:
            body.finish()
        if self._refresher is not None and not has_expiry(response):
            self._refresher.offer(object_key, response.get("LastModified"))
        return got

    def _expire(self, object_key: str, response: Mapping[str, Any]) -> None:
        """An object past its tenant's TTL was seen: close its response, delete it, count it."""
        if "Body" in response:
            close_response(response)
        with self._lock:
            self._expired_total += 1
        # Not waited for: this may run on a pool thread, or inside a lookup.
        self._pool.submit(self._delete_expired, object_key)

    def _delete_expired(self, object_key: str) -> None:
        try:
            self._client.delete_object(Bucket=self._config.bucket, Key=object_key)
        except Exception as exc:  # the bucket's lifecycle rule is the backstop
            self._count_error(_error_kind(exc))

    def _refresh(self, object_key: str) -> None:
        """Copy an object onto itself: same bytes, a fresh LastModified (see :mod:`.s3refresh`)."""
        bucket = self._config.bucket
        self._client.copy_object(
            Bucket=bucket,
            Key=object_key,
            CopySource={"Bucket": bucket, "Key": object_key},
            MetadataDirective="REPLACE",
        )

    def _refresh_failed(self, exc: BaseException) -> None:
        if not _is_missing(exc):  # swept or expired meanwhile: nothing to keep
            self._count_error(_error_kind(exc))

    def _clear_prefix(self) -> None:
        bucket = self._config.bucket
        paginator = self._client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=bucket, Prefix=self._config.prefix):
            objects = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            for i in range(0, len(objects), _DELETE_BATCH):
                batch = objects[i : i + _DELETE_BATCH]
                self._client.delete_objects(Bucket=bucket, Delete={"Objects": batch, "Quiet": True})

    # -- helpers ----------------------------------------------------------

    def _delete(self, object_key: str) -> None:
        try:
            self._call(
                "delete",
                lambda: self._client.delete_object(Bucket=self._config.bucket, Key=object_key),
            )
        except Exception:  # missing is fine; failures are counted by _call
            return
