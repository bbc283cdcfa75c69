"""Keep the S3 objects that are read young, so expiry and the size sweeper spare them.

Why: a bucket lifecycle rule expires an object a number of days after it
was created (its ``LastModified``), and the operator's sweeper deletes the
objects with the oldest ``LastModified`` first. Neither knows which objects
are read. A read already has the object's ``LastModified`` (every GET and
HEAD response carries it), so the tier compares it with
``refresh_after_seconds`` and queues the objects past it; one background
thread copies each onto itself (``CopyObject`` with
``MetadataDirective=REPLACE``: S3 refuses a self-copy that changes nothing).
The copy is a new object with the same bytes and a fresh ``LastModified``,
made inside S3: no body passes through the sidecar.

Cost per hit: a comparison of two timestamps; for an object past the
threshold, a set insertion under a lock. The copies run at most
``refresh_per_second`` on their own thread, never on the read's; when
``refresh_queue_depth`` are waiting, more are dropped and counted
(``refresh_dropped_total``), so a burst of stale reads costs nothing on
the read path. After one copy the object is young for every sidecar, so an
object read all the time is copied about once per ``refresh_after_seconds``
(two sidecars reading it in the same instant may both copy it: harmless).
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

logger = logging.getLogger(__name__)


class Refresher:
    """A bounded, rate-limited queue of self-copies, drained by one thread."""

    def __init__(
        self,
        copy: Callable[[str], None],
        after_seconds: float,
        per_second: float,
        depth: int,
        on_error: Callable[[BaseException], None],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._copy = copy
        self._after = after_seconds
        self._interval = 1.0 / per_second
        self._depth = depth
        self._on_error = on_error
        self._clock = clock  # wall clock: compared with the server's LastModified
        self._pending: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._busy = False
        self._closed = False
        self.refreshed_total = 0
        self.dropped_total = 0
        self._thread = threading.Thread(target=self._run, name="kvstrata-s3-refresh", daemon=True)
        self._thread.start()

    def offer(self, object_key: str, last_modified: dt.datetime | None) -> None:
        """Queue ``object_key`` when it is older than the threshold (cheap; never blocks)."""
        if last_modified is None:
            return
        if self._clock() - last_modified.timestamp() < self._after:
            return
        with self._lock:
            if self._closed or object_key in self._pending:
                return
            if len(self._pending) >= self._depth:
                self.dropped_total += 1
                return
            self._pending[object_key] = None
            self._changed.notify_all()

    def drain(self, timeout: float) -> bool:
        """Wait until nothing is queued or being copied; False on timeout."""
        with self._changed:
            return self._changed.wait_for(
                lambda: not self._pending and not self._busy, timeout=timeout
            )

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._pending.clear()
            self._changed.notify_all()
        self._thread.join(timeout=5.0)

    def _run(self) -> None:
        next_at = 0.0
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._closed or bool(self._pending))
                if self._closed:
                    return
                # The rate limit: wait out the interval since the last copy.
                delay = next_at - time.monotonic()
                if delay > 0:
                    self._changed.wait(delay)
                    continue
                object_key, _ = self._pending.popitem(last=False)
                self._busy = True
            next_at = time.monotonic() + self._interval
            try:
                self._copy(object_key)
                done = True
            except Exception as exc:  # counted by the tier; the object may simply be gone
                logger.debug("s3 refresh of %s failed: %s", object_key, exc)
                self._on_error(exc)
                done = False
            with self._changed:
                self._busy = False
                if done:
                    self.refreshed_total += 1
                self._changed.notify_all()
