"""What a tier counts, read by the sidecar's metrics and /status at scrape.

Why a module of its own: every tier keeps the same core counters (bytes,
objects, hits, evictions, errors, its write queue), and some keep more that
only they have: a shared tier its circuit breaker (:class:`BreakerStats`),
S3 its expiry refreshes and lookup GETs (:class:`S3Stats`), Valkey the
server's own evictions (:class:`ValkeyStats`). Those parts ride on
:class:`TierStats` only where the tier has them (``None`` elsewhere), so
the stats of a disk tier say nothing about S3.

Shape, as ``/status`` shows it for each tier (``asdict``)::

    tier: s3
    usage_bytes: 0          # ... the core counters ...
    errors_total: {timeout: 2}
    breaker: {state: closed, opened_total: 0}        # shared tiers, else null
    backend: {refreshed_total: 1, ..., expired_total: 0}   # S3Stats | ValkeyStats | null

The metrics read the flat names they always read (``refreshed_total``,
``breaker_state``, ``server_evicted_keys`` ...) through the properties at
the end of :class:`TierStats`, with the value a tier without that part has
always shown (0, ``""`` or None): the series on /metrics are unchanged.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace

__all__ = ["BreakerStats", "S3Stats", "TierStats", "ValkeyStats"]


@dataclass
class BreakerStats:
    """A shared tier's circuit breaker (:mod:`kvstrata.sidecar.tiers.breaker`)."""

    state: str = "closed"  # closed | open | half_open
    opened_total: int = 0


@dataclass
class S3Stats:
    """What only the S3 tier counts."""

    # Objects copied onto themselves to push their expiry back (tiers.s3refresh).
    refreshed_total: int = 0
    refresh_dropped_total: int = 0
    # GET responses a lookup opened, read by the fetch or closed unread (tiers.s3ahead).
    lookup_gets_used_total: int = 0
    lookup_gets_closed_total: int = 0
    # Objects read past their tenant's TTL (tiers.s3expiry): a miss, deleted.
    expired_total: int = 0


@dataclass
class ValkeyStats:
    """What only the Valkey tier counts."""

    # The server's own evicted_keys (INFO stats); None until it has answered.
    server_evicted_keys: int | None = None


@dataclass
class TierStats:
    """The core counters every tier keeps, and the parts only some have (module docstring)."""

    tier: str
    usage_bytes: int = 0
    capacity_bytes: int = 0
    objects: int = 0
    stored_bytes_total: int = 0
    retrieved_bytes_total: int = 0
    hits_total: int = 0
    misses_total: int = 0
    evictions_total: int = 0
    # Evictions of objects stored less than young_eviction_seconds before (thrash).
    young_evictions_total: int = 0
    corrupt_total: int = 0
    queue_depth: int = 0
    queue_capacity: int = 0
    dropped_total: int = 0
    deduplicated_total: int = 0
    degraded: bool = False
    # Why the tier is degraded, for /status ("" while it is not).
    degraded_reason: str = ""
    errors_total: dict[str, int] = field(default_factory=dict)
    # Objects not served by encryption at rest, by reason (objformat.SealError).
    decrypt_failures_total: dict[str, int] = field(default_factory=dict)
    breaker: BreakerStats | None = None  # a shared tier's circuit breaker
    backend: S3Stats | ValkeyStats | None = None  # what only this tier's backend counts

    def count_error(self, kind: str) -> None:
        self.errors_total[kind] = self.errors_total.get(kind, 0) + 1

    def count_decrypt_failure(self, reason: str) -> None:
        self.decrypt_failures_total[reason] = self.decrypt_failures_total.get(reason, 0) + 1

    def snapshot(self) -> TierStats:
        """A copy that later counting does not change (its maps and parts copied too)."""
        return replace(
            self,
            errors_total=dict(self.errors_total),
            decrypt_failures_total=dict(self.decrypt_failures_total),
            breaker=copy.copy(self.breaker),
            backend=copy.copy(self.backend),
        )

    # -- the flat names the metrics read (module docstring) ----------------------------

    @property
    def breaker_state(self) -> str:
        """The breaker's state; "" for a tier without one."""
        return self.breaker.state if self.breaker is not None else ""

    @property
    def breaker_opened_total(self) -> int:
        return self.breaker.opened_total if self.breaker is not None else 0

    @property
    def refreshed_total(self) -> int:
        return self._s3.refreshed_total

    @property
    def refresh_dropped_total(self) -> int:
        return self._s3.refresh_dropped_total

    @property
    def lookup_gets_used_total(self) -> int:
        return self._s3.lookup_gets_used_total

    @property
    def lookup_gets_closed_total(self) -> int:
        return self._s3.lookup_gets_closed_total

    @property
    def expired_total(self) -> int:
        return self._s3.expired_total

    @property
    def server_evicted_keys(self) -> int | None:
        """The Valkey server's evictions; None for other tiers."""
        backend = self.backend
        return backend.server_evicted_keys if isinstance(backend, ValkeyStats) else None

    @property
    def _s3(self) -> S3Stats:
        """The S3 part, or zeros for another tier (its series have always read 0)."""
        return self.backend if isinstance(self.backend, S3Stats) else _NO_S3


_NO_S3 = S3Stats()
