"""What a read of the S3 tier does about an object's age: expire it, or keep it young.

Why a module of its own: every read that sees an object's response headers
(a lookup's HEAD or GET, a fetch's GET, a read into an L1 slot) asks the
same two questions. Past its tenant's TTL (:mod:`.s3expiry`), the object is
a miss: its response is closed, it is deleted in the background and
counted (``expired_total``). Read and without a TTL of its own, it is
offered to the :class:`~.s3refresh.Refresher` (``refresh_after_seconds``),
which copies it onto itself so expiry and the size sweeper spare it.
:class:`ObjectAges` owns both counts and the refresher; the tier
(:class:`~kvstrata.sidecar.tiers.s3.S3Tier`) asks it at each read.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

from kvstrata.sidecar.config import S3Config
from kvstrata.sidecar.tiers.s3ahead import close_response
from kvstrata.sidecar.tiers.s3client import copy_onto_itself, error_kind, is_missing
from kvstrata.sidecar.tiers.s3expiry import expired, has_expiry
from kvstrata.sidecar.tiers.s3refresh import Refresher

__all__ = ["ObjectAges"]


class ObjectAges:
    """The expiry and refresh of the objects reads see (module docstring).

    ``submit`` runs a deletion in the background (the tier's pool: a read
    never waits for it); ``count_error`` counts a failed deletion or copy
    by kind (:func:`.s3client.error_kind`) in the tier's stats."""

    def __init__(
        self,
        client: Any,
        config: S3Config,
        submit: Callable[[Callable[[str], None], str], Any],
        count_error: Callable[[str], None],
    ) -> None:
        self._client = client
        self._bucket = config.bucket
        self._submit = submit
        self._count_error = count_error
        self._lock = threading.Lock()  # guards _expired_total
        self._expired_total = 0
        self._refresher: Refresher | None = None
        if config.refresh_after_seconds is not None:
            self._refresher = Refresher(
                self._refresh,
                after_seconds=config.refresh_after_seconds,
                per_second=config.refresh_per_second,
                depth=config.refresh_queue_depth,
                on_error=self._refresh_failed,
            )

    def past_ttl(self, name: str, response: Mapping[str, Any]) -> bool:
        """Whether object ``name``, answered by ``response``, is past its
        tenant's TTL; if so its response is closed, and it is deleted and counted."""
        if not expired(response):
            return False
        if "Body" in response:
            close_response(response)
        with self._lock:
            self._expired_total += 1
        # Not waited for: this may run on a pool thread, or inside a lookup.
        self._submit(self._delete, name)
        return True

    def read(self, name: str, response: Mapping[str, Any]) -> None:
        """Object ``name`` was read (found, or placed): kept young, unless its
        tenant's TTL decides its end."""
        if self._refresher is not None and not has_expiry(response):
            self._refresher.offer(name, response.get("LastModified"))

    @property
    def expired_total(self) -> int:
        with self._lock:
            return self._expired_total

    @property
    def refreshed_total(self) -> int:
        return self._refresher.refreshed_total if self._refresher is not None else 0

    @property
    def refresh_dropped_total(self) -> int:
        return self._refresher.dropped_total if self._refresher is not None else 0

    def drain(self, timeout: float) -> bool:
        """Wait until queued refreshes are done (tests, shutdown); True at once without any."""
        return self._refresher is None or self._refresher.drain(timeout)

    def close(self) -> None:
        if self._refresher is not None:
            self._refresher.close()

    def _delete(self, name: str) -> None:
        try:
            self._client.delete_object(Bucket=self._bucket, Key=name)
        except Exception as exc:  # the bucket's lifecycle rule is the backstop
            self._count_error(error_kind(exc))

    def _refresh(self, name: str) -> None:
        copy_onto_itself(self._client, self._bucket, name)

    def _refresh_failed(self, exc: BaseException) -> None:
        if not is_missing(exc):  # swept or expired meanwhile: nothing to keep
            self._count_error(error_kind(exc))
