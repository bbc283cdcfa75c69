"""What the shared tiers on the network (Valkey, S3) have in common.

Both keep the same counters, guard every call with a :class:`CircuitBreaker`
(while it is open a call answers miss / False without touching the network
and counts ``errors_total["breaker_open"]``), check each object's meta
before the breaker is asked (bad meta raises ``ValueError`` even while it
is open) and let the backend choose where objects are encoded (S3: on
each upload's thread),
and treat a fetched value that fails validation the same way: counted in
``corrupt_total``, deleted, answered as a miss. :class:`RemoteTier` holds
that contract once; a backend supplies only its I/O (the ``_exists``,
``_fetch``, ``_store_many``, ``_delete`` and ``_clear`` hooks) and how it
counts a failure.
"""

from __future__ import annotations

import abc
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvstrata.sidecar.config import SharedConfig
from kvstrata.sidecar.keys import ChunkKey
from kvstrata.sidecar.objformat import (
    ChunkMeta,
    CorruptObjectError,
    DecodedObject,
    SealError,
    StreamedObject,
    check_meta,
    decode,
    encode_streamed,
)
from kvstrata.sidecar.tiers.base import PutOutcome, Tier, TierStats
from kvstrata.sidecar.tiers.breaker import CircuitBreaker
from kvstrata.sidecar.tiers.stats import BreakerStats

if TYPE_CHECKING:
    from kvstrata.sidecar.sealing import KeyRing

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Validated:
    """A fetched object the backend already decoded and checked on its own
    thread (so one object's checksum runs while others are still arriving),
    opened with the tier's keys when sealed."""

    obj: DecodedObject
    nbytes: int  # the stored object's length (retrieved_bytes_total)


# A fetched value: its bytes (or already validated), or None / the exception
# when it is missing or the fetch failed (a failure is already counted by then).
Fetched = bytes | memoryview | Validated | BaseException | None
# A stored object's outcome: True stored, False already there (deduplicated),
# an exception when it was not stored (already counted).
Stored = bool | BaseException
# Encodes one object (header, codec) when called; its payload checksum is
# computed while it is sent (objformat version 3, checksum in a trailer).
Encoder = Callable[[], StreamedObject]


def read_secret(path: str, field: str) -> str:
    """A mounted secret file's content; a ValueError naming the config field if unreadable."""
    try:
        with open(path) as fh:
            return fh.read().strip()
    except OSError as exc:
        raise ValueError(f"{field}: cannot read {path}: {exc.strerror}") from None


class RemoteTier(Tier):
    """A tier behind a network endpoint: breaker, counters, validation."""

    def __init__(
        self,
        config: SharedConfig,
        timeout_seconds: float,
        tenant_ttl_seconds: Mapping[str, float] | None = None,
        keys: KeyRing | None = None,
    ) -> None:
        """``tenant_ttl_seconds``: a tenant's TTL (kvstrata.sidecar.tenants),
        applied by backends that expire objects themselves (Valkey)."""
        self._codec = config.codec
        self._tenant_ttl = dict(tenant_ttl_seconds or {})
        # Seal objects written, open objects read (None: encryption off).
        self._keys = keys
        # A lookup never waits longer than any other call of the tier.
        self._lookup_timeout = min(config.lookup_timeout_seconds, timeout_seconds)
        self._breaker = CircuitBreaker(config.breaker_failures, config.breaker_reset_seconds)
        self._stats = TierStats(tier=self.name)
        self._lock = threading.Lock()  # guards _stats and _probe_failure
        self._probe_failure = ""  # what the last failed probe said; "" after a success

    # -- backend hooks ----------------------------------------------------

    @abc.abstractmethod
    def _name(self, key: ChunkKey) -> str:
        """The backend's name (key, object key) of a chunk's object."""

    @abc.abstractmethod
    def _exists(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """For each key, whether its object is there within the lookup deadline."""

    def _exists_ahead(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """:meth:`_exists` for :meth:`contains_many_ahead`; a backend that can
        start the fetches with the question overrides it."""
        return self._exists(keys)

    @abc.abstractmethod
    def _fetch(self, keys: Sequence[ChunkKey], names: Sequence[str]) -> list[Fetched]:
        """The stored values of ``names`` (the objects of ``keys``), each as
        :data:`Fetched` says."""

    @abc.abstractmethod
    def _store_many(
        self,
        names: Sequence[str],
        objects: Sequence[Encoder],
        ttls: Sequence[float | None],
        tenants: Sequence[str],
    ) -> list[Stored]:
        """Write each object unless it exists; one :data:`Stored` each.
        ``ttls[i]``: seconds object i may live (its tenant's TTL), None: as
        the tier's own settings say; ``tenants[i]``: object i's tenant ("":
        the default tenant), for a backend that keeps tenants' budgets.

        ``objects[i]()`` encodes object i; call each once, where the encoding
        should run: a backend that uploads objects on threads of its own
        encodes each on its upload's thread, so one object's compression runs
        while others are on the wire instead of all of them before the first.
        Send each object's bytes through its :class:`StreamedObject`
        (``pieces`` or ``read_at``), which hashes the payload as it goes out.
        """

    @abc.abstractmethod
    def _ping(self) -> None:
        """One cheap round trip (Valkey PING, S3 HEAD of the bucket); raises on failure."""

    @abc.abstractmethod
    def _delete(self, name: str) -> None:
        """Delete one object; a failure is counted, never raised."""

    def _delete_many(self, names: Sequence[str]) -> None:
        """Delete several objects (one call where the backend allows); never raises."""
        for name in names:
            self._delete(name)

    @abc.abstractmethod
    def _clear(self) -> None:
        """Delete every object of this tier's prefix; failures counted, never raised."""

    # -- Tier -------------------------------------------------------------

    def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        return self._ask(keys, self._exists)

    def contains_many_ahead(self, keys: Sequence[ChunkKey]) -> list[bool]:
        return self._ask(keys, self._exists_ahead)

    def _ask(
        self, keys: Sequence[ChunkKey], exists: Callable[[Sequence[ChunkKey]], list[bool]]
    ) -> list[bool]:
        """``exists(keys)`` unless there is nothing to ask or the breaker refuses."""
        if not keys:
            return []
        if not self._allow():
            return [False] * len(keys)
        return exists(keys)

    def get(self, key: ChunkKey) -> DecodedObject | None:
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[ChunkKey]) -> list[DecodedObject | None]:
        """Fetch all keys in one batch; anything not validated is a miss."""
        if not keys:
            return []
        if not self._allow():
            self._count(misses=len(keys))
            return [None] * len(keys)
        names = [self._name(k) for k in keys]
        blobs = self._fetch(keys, names)
        return [self._validated(k, n, b) for k, n, b in zip(keys, names, blobs, strict=True)]

    def put(self, key: ChunkKey, payload: bytes | memoryview, meta: ChunkMeta) -> bool:
        return self.put_many([(key, payload, meta)])[0]

    def put_outcome(
        self, key: ChunkKey, payload: bytes | memoryview, meta: ChunkMeta
    ) -> PutOutcome:
        return self._put_outcomes([(key, payload, meta)])[0]

    def put_many(
        self, items: Sequence[tuple[ChunkKey, bytes | memoryview, ChunkMeta]]
    ) -> list[bool]:
        """Store a batch; an object already there counts as stored (deduplicated)."""
        return [outcome != "failed" for outcome in self._put_outcomes(items)]

    def _put_outcomes(
        self, items: Sequence[tuple[ChunkKey, bytes | memoryview, ChunkMeta]]
    ) -> list[PutOutcome]:
        """Store a batch unless present: what happened to each (first writer wins)."""
        if not items:
            return []
        # Bad meta raises ValueError before anything is sent.
        for key, _, meta in items:
            check_meta(bytes(key), meta)
        if not self._allow():
            return ["failed"] * len(items)
        sizes = [0] * len(items)

        def encoder(i: int, key: ChunkKey, payload: bytes | memoryview, meta: ChunkMeta) -> Encoder:
            def run() -> StreamedObject:
                obj = encode_streamed(bytes(key), payload, meta, self._codec, self._keys)
                sizes[i] = len(obj)
                return obj

            return run

        encoders = [encoder(i, *item) for i, item in enumerate(items)]
        ttls = [self._tenant_ttl.get(meta.tenant) if meta.tenant else None for _, _, meta in items]
        tenants = [meta.tenant for _, _, meta in items]
        outcomes = self._store_many([self._name(k) for k, _, _ in items], encoders, ttls, tenants)
        with self._lock:
            for size, outcome in zip(sizes, outcomes, strict=True):
                if outcome is True:
                    self._stats.stored_bytes_total += size
                elif outcome is False:  # another writer stored this chunk first
                    self._stats.deduplicated_total += 1
        return ["stored" if o is True else "present" if o is False else "failed" for o in outcomes]

    def remove(self, key: ChunkKey) -> None:
        if self._allow():
            self._delete(self._name(key))

    def remove_many(self, keys: Sequence[ChunkKey]) -> None:
        if keys and self._allow():
            self._delete_many([self._name(k) for k in keys])

    def clear(self) -> None:
        if self._allow():
            self._clear()

    def stats(self) -> TierStats:
        with self._lock:
            snap = self._stats.snapshot()
        snap.breaker = BreakerStats(self._breaker.state, self._breaker.opened_total)
        snap.degraded = snap.breaker.state != "closed"
        if snap.degraded:
            with self._lock:
                probe_failure = self._probe_failure
            snap.degraded_reason = probe_failure or (
                f"circuit breaker {snap.breaker.state} after failed calls"
            )
        return snap

    def probe(self) -> str | None:
        """See :meth:`Tier.probe`: a failure opens the breaker at once."""
        try:
            self._ping()
        except Exception as exc:  # whatever the client raises, the answer is "not reachable"
            why = " ".join(str(exc).split()) or type(exc).__name__
            with self._lock:
                self._probe_failure = f"unreachable: {why}"
            self._breaker.trip()
            return why
        with self._lock:
            self._probe_failure = ""
        self._breaker.record_success()
        return None

    # -- helpers ----------------------------------------------------------

    def _allow(self) -> bool:
        """Whether the breaker lets a call through; a refusal is counted."""
        if self._breaker.allow():
            return True
        self._count_error("breaker_open")
        return False

    def _count_error(self, kind: str) -> None:
        with self._lock:
            self._stats.count_error(kind)

    def _count(self, hits: int = 0, misses: int = 0) -> None:
        with self._lock:
            self._stats.hits_total += hits
            self._stats.misses_total += misses

    def _validated(self, key: ChunkKey, name: str, blob: Fetched) -> DecodedObject | None:
        """Decode one fetched value; a corrupt one is counted, deleted and a miss."""
        if blob is None or isinstance(blob, BaseException):
            self._count(misses=1)
            return None
        if isinstance(blob, Validated):
            self._count_hit(blob.nbytes)
            return blob.obj
        try:
            obj = decode(blob, expected_key=bytes(key), keys=self._keys)
        except SealError as exc:
            self._refuse_sealed(name, exc.reason)
            return None
        except CorruptObjectError as exc:
            self._drop_corrupt(name, str(exc))
            return None
        self._count_hit(len(blob))
        return obj

    def _count_hit(self, nbytes: int) -> None:
        """A validated object of ``nbytes`` stored bytes was read."""
        with self._lock:
            self._stats.hits_total += 1
            self._stats.retrieved_bytes_total += nbytes

    def _refuse_sealed(self, name: str, reason: str) -> None:
        """An object the keys could not open (or a plaintext one where encryption
        is required): counted by reason, a miss. Deleted only when it is bad
        for every reader (a failed tag, or plaintext where encryption is
        required): a sidecar that has not yet seen a rotated key, or one still
        running with encryption off during a rollout, must not delete what its
        peers wrote and can read."""
        logger.debug("%s object %s not opened: %s", self.name, name, reason)
        with self._lock:
            self._stats.count_decrypt_failure(reason)
            self._stats.misses_total += 1
        if reason in ("auth_failed", "plaintext"):
            self._delete(name)

    def _drop_corrupt(self, name: str, why: str) -> None:
        """A fetched object failed validation: counted, deleted, a miss."""
        logger.warning("%s object %s is corrupt (%s); deleting it", self.name, name, why)
        with self._lock:
            self._stats.corrupt_total += 1
            self._stats.misses_total += 1
        self._delete(name)
