"""The engine's counters and gauges, as typed fields.

Why a module of its own: the counters are written by the L1 index, the
prefix walk and write-behind, and read by the Prometheus collector
(:mod:`.metrics`) and the STATS reply; a field named once here is checked
by the type checker at every one of those places, where a counter named by
a string was spelled again (and decoded again by prefix) at each of them.

Every field of :class:`EngineCounters` only grows; it is changed under the
L1 index's lock (:meth:`kvstrata.sidecar.l1index.L1Index.tally`) and read
as a copy (:meth:`EngineCounters.copy`). :class:`EngineGauges` are read at
one moment, never counted.

:class:`EngineStats` carries both, with each tier's figures, to the
collector. The STATS reply and ``/status`` show counters and gauges as one flat dictionary
(:func:`as_status`) under the names they have always had there: clients and
dashboards read those names.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from kvstrata.sidecar.tenants import TenantSnapshot
from kvstrata.sidecar.tiers.base import TierStats

__all__ = ["EngineCounters", "EngineGauges", "EngineStats", "as_status"]


@dataclass(slots=True)
class EngineCounters:
    """What the engine counted since it started (each field only grows)."""

    # Lookups answered by the prefix walk, the chunks they named, and per
    # tier the chunks of the answered prefix each tier held.
    lookups_total: int = 0
    lookup_chunks_total: int = 0
    hit_chunks_total: dict[str, int] = field(default_factory=dict)
    # L1's own figures (the l1 series of the per-tier families).
    hits_total: int = 0
    misses_total: int = 0
    stored_bytes_total: int = 0
    retrieved_bytes_total: int = 0
    # Prefetch: chunks leased ahead of a read, and their bytes.
    prefetch_chunks_total: int = 0
    prefetched_bytes_total: int = 0
    leases_expired_total: int = 0
    store_rejected_total: int = 0
    store_deduplicated_total: int = 0
    # Chunks copied up into L1, per tier they came from, and fills that failed.
    promotions_total: dict[str, int] = field(default_factory=dict)
    promotion_failures_total: int = 0
    writeback_skipped_total: int = 0
    shared_already_held_total: int = 0
    partial_stored_total: int = 0
    partial_replaced_total: int = 0
    partial_dropped_total: int = 0
    partial_hits_total: int = 0
    partial_mismatch_total: int = 0
    partial_superseded_deleted_total: int = 0

    def copy(self) -> EngineCounters:
        """A copy that later counting does not change."""
        return replace(
            self,
            hit_chunks_total=dict(self.hit_chunks_total),
            promotions_total=dict(self.promotions_total),
        )


@dataclass(frozen=True, slots=True)
class EngineGauges:
    """The engine's state at one moment (what a gauge shows)."""

    leases_active: int = 0
    quarantined_bytes: int = 0  # expired write leases whose writer may still write
    writeback_pinned_bytes: int = 0
    writeback_backlog: int = 0  # writes waiting for write-behind's pin budget
    l1_free_largest_bytes: int = 0
    queued_loads: int = 0  # chunks a prefetch has not landed yet


@dataclass(slots=True)
class EngineStats:
    """A snapshot for metrics: per-tier stats, the engine's counters and gauges."""

    tiers: dict[str, TierStats]
    counters: EngineCounters = field(default_factory=EngineCounters)
    gauges: EngineGauges = field(default_factory=EngineGauges)
    tenants: TenantSnapshot = field(default_factory=TenantSnapshot)


def as_status(counters: EngineCounters, gauges: EngineGauges) -> dict[str, int]:
    """The flat ``counters`` dictionary of the STATS reply and ``/status``."""
    c = counters
    out = {
        "lookups_total": c.lookups_total,
        "lookup_chunks_total": c.lookup_chunks_total,
        "prefetch_chunks_total": c.prefetch_chunks_total,
        "prefetched_bytes_total": c.prefetched_bytes_total,
        "leases_expired_total": c.leases_expired_total,
        "store_rejected_total": c.store_rejected_total,
        "store_deduplicated_total": c.store_deduplicated_total,
        "promotion_failed_total": c.promotion_failures_total,
        "writeback_skipped_total": c.writeback_skipped_total,
        "shared_already_held_total": c.shared_already_held_total,
        "partial_stored_total": c.partial_stored_total,
        "partial_replaced_total": c.partial_replaced_total,
        "partial_dropped_total": c.partial_dropped_total,
        "partial_hits_total": c.partial_hits_total,
        "partial_mismatch_total": c.partial_mismatch_total,
        "partial_superseded_deleted_total": c.partial_superseded_deleted_total,
        "leases_active": gauges.leases_active,
        "quarantined_bytes": gauges.quarantined_bytes,
        "writeback_pinned_bytes": gauges.writeback_pinned_bytes,
        "writeback_backlog": gauges.writeback_backlog,
        "l1_free_largest_bytes": gauges.l1_free_largest_bytes,
        "queued_loads": gauges.queued_loads,
    }
    for tier, n in c.hit_chunks_total.items():
        out[f"hit_chunks_total_{tier}"] = n
    for tier, n in c.promotions_total.items():
        out[f"promotions_total_{tier}"] = n
    return out
