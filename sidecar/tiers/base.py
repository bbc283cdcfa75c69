"""The interface every tier below L1 implements, and the write-behind queue
that feeds them.

Contract of a :class:`Tier` (the engine relies on each point):

* Thread-safe: the engine calls from request threads and writer threads.
* ``get`` returns a validated :class:`DecodedObject` or None. A missing,
  corrupt (checksum, truncation, wrong key) or unreachable object is None,
  never an exception and never wrong bytes; the tier counts why in its stats.
* ``put`` is synchronous and may be slow; the engine never calls it on a
  request path, only from a :class:`WriteBehindQueue` worker. It returns
  False when the object was not stored (full, error, refused).
* ``put_outcome`` is ``put`` saying whether the tier already held an object
  under that key (:data:`PutOutcome` ``"present"``): a shared tier never
  overwrites one (the first writer wins), and the engine then drops its own
  copies so that every tier answers a key with the same bytes.
* ``contains_many`` answers for a batch of keys at once (one round trip for
  remote tiers) and respects the tier's lookup deadline: an unanswered key
  is False.
* No method raises for I/O or remote failures; programming errors
  (bad arguments) may raise ``ValueError``.
"""

from __future__ import annotations

import abc
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from kvstrata.sidecar.keys import ChunkKey
from kvstrata.sidecar.objformat import ChunkMeta, DecodedObject

# A tier's counters live in their own module; importable from here, as before.
from kvstrata.sidecar.tiers.stats import TierStats

if TYPE_CHECKING:
    from kvstrata.sidecar.journal import TierEvents
    from kvstrata.sidecar.tiers.tenant_shares import TenantFigures

logger = logging.getLogger(__name__)


# What a put did: "stored" (written now), "present" (an object was already
# there under that key and was kept as it is), "failed" (not stored).
PutOutcome = Literal["stored", "present", "failed"]

# Where a payload of (length, meta) goes: a writable view of exactly that
# length, or None when there is nowhere to put it (see Tier.get_into).
Place = Callable[[int, ChunkMeta], memoryview | None]


def copy_placed(obj: DecodedObject, place: Place) -> ChunkMeta | None:
    """Copy a validated object's payload where ``place`` says: its meta, or
    None when ``place`` had nowhere to put it (see :meth:`Tier.get_into`)."""
    payload = memoryview(obj.payload).cast("B")
    dest = place(len(payload), obj.meta)
    if dest is None:
        return None
    dest[:] = payload
    return obj.meta


class Tier(abc.ABC):
    """A store of chunk objects below L1 (see the module docstring)."""

    name: str
    # Whether the tier expires each object by its tenant's TTL itself (Valkey's
    # per-key expiry); where not, a tenant with a TTL is not written to it.
    expires_per_key: bool = False

    @abc.abstractmethod
    def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """For each key, whether a ``get`` would likely find it."""

    def contains_many_ahead(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """``contains_many`` for a caller about to fetch every key found, in
        order: a tier may start those fetches with the question (S3 answers
        from GETs whose bodies the fetches then read)."""
        return self.contains_many(keys)

    def contains(self, key: ChunkKey) -> bool:
        """``contains_many`` for one key; local tiers answer from memory."""
        return self.contains_many([key])[0]

    @abc.abstractmethod
    def get(self, key: ChunkKey) -> DecodedObject | None:
        """The validated object, or None (missing, corrupt or unreachable)."""

    @abc.abstractmethod
    def put(self, key: ChunkKey, payload: bytes | memoryview, meta: ChunkMeta) -> bool:
        """Store one object synchronously; True when stored."""

    def put_outcome(
        self, key: ChunkKey, payload: bytes | memoryview, meta: ChunkMeta
    ) -> PutOutcome:
        """``put``, saying whether an object was already there (see the module
        docstring); this default, for tiers that overwrite, never says so."""
        return "stored" if self.put(key, payload, meta) else "failed"

    @abc.abstractmethod
    def remove(self, key: ChunkKey) -> None:
        """Forget one object; absent keys are fine."""

    def remove_many(self, keys: Sequence[ChunkKey]) -> None:
        """``remove`` for a batch; remote tiers send one request."""
        for key in keys:
            self.remove(key)

    @abc.abstractmethod
    def clear(self) -> None:
        """Forget every object of this tier (this namespace prefix only, for shared tiers)."""

    @abc.abstractmethod
    def stats(self) -> TierStats:
        """A snapshot of the tier's counters."""

    def get_many(self, keys: Sequence[ChunkKey]) -> list[DecodedObject | None]:
        """``get`` for a batch; remote tiers override it with one round trip."""
        return [self.get(key) for key in keys]

    def get_into(self, key: ChunkKey, place: Place) -> ChunkMeta | None:
        """Read ``key``'s payload into the buffer ``place`` names once the
        payload's length and meta are known; the meta when the bytes written
        there are the validated payload, else None (a miss; when ``place`` was
        called, what it named holds no valid payload). ``place`` may answer
        None (nowhere to put it): the read is dropped and None returned.

        This default reads the whole object, then copies it; a tier that can
        receive straight into the destination overrides it (Valkey).
        """
        obj = self.get(key)
        return None if obj is None else copy_placed(obj, place)

    def put_many(
        self, items: Sequence[tuple[ChunkKey, bytes | memoryview, ChunkMeta]]
    ) -> list[bool]:
        """``put`` for a batch of (key, payload, meta); remote tiers pipeline it."""
        return [self.put(key, payload, meta) for key, payload, meta in items]

    def tenant_figures(self) -> TenantFigures | None:
        """What the tier counts per tenant itself (its budgets' refusals, and
        bytes where it knows them); None for a tier without tenant budgets."""
        return None

    def probe(self) -> str | None:
        """One round trip to the tier's backend: None when it answers, else why
        not (the tier then counts itself degraded until a call succeeds). Asked
        at start and, while it fails, again in the background by
        :mod:`kvstrata.sidecar.tiers.reachability`; local tiers have nothing to ask."""
        return None

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections, threads and files."""


@dataclass(slots=True)
class WriteJob:
    key: ChunkKey
    payload: bytes | memoryview
    meta: ChunkMeta
    # Called after the write with its outcome; the engine releases the L1
    # read lease it took for the payload here.
    on_done: Callable[[bool], None] | None = None
    # Called before on_done when the tier already held an object under the
    # key (and kept it): the engine's copies yield to it.
    on_present: Callable[[], None] | None = None
    # Called in place of on_done(False), on the submitting thread, when
    # ``submit`` does not take the job (queue full, key already queued or
    # stored, queue closed): the tier was never asked.
    on_dropped: Callable[[], None] | None = None


class WriteBehindQueue:
    """A bounded queue of writes into one tier, drained by worker threads.

    ``submit`` never blocks: when the queue is full the job is dropped,
    counted in ``stats.dropped_total`` and its ``on_dropped()`` (else its
    ``on_done(False)``) is called.
    Keys already queued, or (when ``already_stored`` says so) already in the
    tier, are not written twice.
    """

    def __init__(
        self,
        tier: Tier,
        capacity: int,
        threads: int = 1,
        already_stored: Callable[[ChunkKey], bool] | None = None,
        name: str | None = None,
    ) -> None:
        self.tier = tier
        # Told of every successful write (the KV event journal), when set.
        self.events: TierEvents | None = None
        self.capacity = capacity
        self.dropped_total = 0
        self.deduplicated_total = 0
        self.written_total = 0
        self.failed_total = 0
        self._already_stored = already_stored
        self._queue: queue.Queue[WriteJob | None] = queue.Queue(maxsize=capacity)
        self._pending: set[ChunkKey] = set()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._in_flight = 0
        self._closed = False
        self._threads = [
            threading.Thread(
                target=self._run, name=f"kvstrata-{name or tier.name}-writer-{i}", daemon=True
            )
            for i in range(threads)
        ]
        for thread in self._threads:
            thread.start()

    @property
    def depth(self) -> int:
        return self._queue.qsize()

    def submit(self, job: WriteJob) -> bool:
        """Queue a write; False (and ``on_done(False)``) if dropped or deduplicated."""
        with self._lock:
            if self._closed:
                accepted = False
            elif job.key in self._pending or (
                self._already_stored is not None and self._already_stored(job.key)
            ):
                self.deduplicated_total += 1
                accepted = False
            else:
                try:
                    self._queue.put_nowait(job)
                except queue.Full:
                    self.dropped_total += 1
                    accepted = False
                else:
                    self._pending.add(job.key)
                    self._in_flight += 1
                    accepted = True
        if not accepted:
            if job.on_dropped is not None:
                job.on_dropped()
            elif job.on_done is not None:
                job.on_done(False)
        return accepted

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every accepted job is written; False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._in_flight == 0, timeout=timeout)

    def close(self, timeout: float = 5.0) -> None:
        with self._lock:
            self._closed = True
        for _ in self._threads:
            try:
                self._queue.put(None, timeout=timeout)
            except queue.Full:
                break
        for thread in self._threads:
            thread.join(timeout=timeout)

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            ok = False
            try:
                outcome = self.tier.put_outcome(job.key, job.payload, job.meta)
                ok = outcome != "failed"
                if outcome == "present" and job.on_present is not None:
                    job.on_present()
            except Exception:  # a tier must not raise; keep the writer alive if one does
                logger.exception("tier %s raised from put", self.tier.name)
            finally:
                if ok and self.events is not None:
                    self.events.stored(job.key)
                with self._lock:
                    self._pending.discard(job.key)
                    if ok:
                        self.written_total += 1
                    else:
                        self.failed_total += 1
                if job.on_done is not None:
                    try:
                        job.on_done(ok)
                    except Exception:
                        logger.exception("write-behind callback failed")
                with self._lock:
                    self._in_flight -= 1
                    self._idle.notify_all()
