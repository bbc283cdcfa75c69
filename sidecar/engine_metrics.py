"""The engine's and its tiers' metrics, read at scrape time from ``engine.stats()``.

Why its own module: these families are read, not counted: the L1 index,
write-behind and the tiers keep the figures (typed fields of
:class:`~kvstrata.sidecar.counters.EngineStats`), and this collector turns
one snapshot of them into Prometheus families on each scrape. The catalogue
rows (names, help, labels) stay in :mod:`.metrics` with every other metric's.
Families whose label values are known in advance (tiers, engine counters)
are served at 0 from the start, so rates and alerts never see gaps.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from kvstrata.sidecar.metrics import SPECS, counter_family, gauge_family

if TYPE_CHECKING:
    from kvstrata.sidecar.counters import EngineCounters, EngineGauges, EngineStats

__all__ = ["BREAKER_STATES", "EngineCollector"]

logger = logging.getLogger(__name__)


class EngineCollector(Collector):
    """Reads engine and tier figures at scrape time (see the module docstring)."""

    def __init__(
        self,
        stats: Callable[[], EngineStats],
        clients: Callable[[], int],
        on_error: Callable[[str], None] | None = None,
    ) -> None:
        self._stats = stats
        self._clients = clients
        self._on_error = on_error

    def describe(self) -> Iterator[Metric]:
        return iter(())  # names are fixed; skip a scrape at registration

    def collect(self) -> Iterator[Metric]:
        clients = gauge_family("kvstrata_clients")
        clients.add_metric([], self._clients())
        yield clients
        try:
            stats = self._stats()
        except Exception:  # a failing engine must not break the scrape
            logger.exception("engine.stats() failed during a scrape")
            if self._on_error is not None:
                self._on_error("stats")
            return
        yield from _tier_metrics(stats)
        yield from _counter_metrics(stats)
        yield from _tenant_metrics(stats)
        free = gauge_family("kvstrata_l1_free_bytes")
        l1 = stats.tiers["l1"]
        free.add_metric([], max(0, l1.capacity_bytes - l1.usage_bytes))
        yield free


# Per-tier families read from each TierStats: metric name -> the value.
_TIER_VALUES: dict[str, Callable[[Any], float]] = {
    "kvstrata_stored_bytes_total": lambda t: t.stored_bytes_total,
    "kvstrata_retrieved_bytes_total": lambda t: t.retrieved_bytes_total,
    "kvstrata_evictions_total": lambda t: t.evictions_total,
    "kvstrata_young_evictions_total": lambda t: t.young_evictions_total,
    "kvstrata_tier_usage_bytes": lambda t: t.usage_bytes,
    "kvstrata_tier_capacity_bytes": lambda t: t.capacity_bytes,
    "kvstrata_tier_objects": lambda t: t.objects,
    "kvstrata_write_queue_depth": lambda t: t.queue_depth,
    "kvstrata_write_queue_dropped_total": lambda t: t.dropped_total,
    "kvstrata_tier_degraded": lambda t: 1 if t.degraded else 0,
    "kvstrata_corrupt_objects_total": lambda t: t.corrupt_total,
    "kvstrata_tier_expired_total": lambda t: t.expired_total,
    "kvstrata_tier_refreshed_total": lambda t: t.refreshed_total,
    "kvstrata_tier_refresh_dropped_total": lambda t: t.refresh_dropped_total,
    "kvstrata_tier_lookup_gets_used_total": lambda t: t.lookup_gets_used_total,
    "kvstrata_tier_lookup_gets_closed_total": lambda t: t.lookup_gets_closed_total,
}


def _tier_metrics(stats: EngineStats) -> Iterator[Metric]:
    families = {
        name: (counter_family(name) if SPECS[name].type == "counter" else gauge_family(name))
        for name in _TIER_VALUES
    }
    tier_errors = counter_family("kvstrata_tier_errors_total")
    for tier_name, tier in stats.tiers.items():
        for name, value in _TIER_VALUES.items():
            families[name].add_metric([tier_name], value(tier))
        for kind, n in tier.errors_total.items():
            tier_errors.add_metric([tier_name, kind], n)
    yield from families.values()
    yield tier_errors
    decrypt_failures = counter_family("kvstrata_decrypt_failures_total")
    for tier_name, tier in stats.tiers.items():
        for reason, n in tier.decrypt_failures_total.items():
            decrypt_failures.add_metric([tier_name, reason], n)
    yield decrypt_failures
    evicted = gauge_family("kvstrata_tier_server_evicted_keys")
    for tier_name, tier in stats.tiers.items():
        if tier.server_evicted_keys is not None:
            evicted.add_metric([tier_name], tier.server_evicted_keys)
    yield evicted
    yield from _breaker_metrics(stats)


BREAKER_STATES = ("closed", "open", "half_open")


def _breaker_metrics(stats: EngineStats) -> Iterator[Metric]:
    """Enum-style state (one series per state, 1 for the current) and opens, for the
    tiers that have a breaker (the shared ones)."""
    state = gauge_family("kvstrata_tier_breaker_state")
    opened = counter_family("kvstrata_tier_breaker_opened_total")
    for tier_name, tier in stats.tiers.items():
        if not tier.breaker_state:
            continue
        for name in BREAKER_STATES:
            state.add_metric([tier_name, name], 1 if tier.breaker_state == name else 0)
        opened.add_metric([tier_name], tier.breaker_opened_total)
    yield state
    yield opened


# Engine counters exposed as metrics of their own: metric name -> its field.
# Always exposed (0 before the first event), so rates and alerts never see gaps.
_ENGINE_COUNTERS: dict[str, Callable[[EngineCounters], int]] = {
    "kvstrata_prefetch_chunks_total": lambda c: c.prefetch_chunks_total,
    "kvstrata_prefetched_bytes_total": lambda c: c.prefetched_bytes_total,
    "kvstrata_leases_expired_total": lambda c: c.leases_expired_total,
    "kvstrata_store_rejected_total": lambda c: c.store_rejected_total,
    "kvstrata_store_deduplicated_total": lambda c: c.store_deduplicated_total,
    "kvstrata_promotion_failures_total": lambda c: c.promotion_failures_total,
    "kvstrata_writeback_skipped_total": lambda c: c.writeback_skipped_total,
    "kvstrata_shared_already_held_total": lambda c: c.shared_already_held_total,
    "kvstrata_partial_stored_total": lambda c: c.partial_stored_total,
    "kvstrata_partial_replaced_total": lambda c: c.partial_replaced_total,
    "kvstrata_partial_dropped_total": lambda c: c.partial_dropped_total,
    "kvstrata_partial_hits_total": lambda c: c.partial_hits_total,
    "kvstrata_partial_mismatch_total": lambda c: c.partial_mismatch_total,
    "kvstrata_partial_superseded_deleted_total": lambda c: c.partial_superseded_deleted_total,
}
# The engine's gauges: metric name -> its field.
_ENGINE_GAUGES: dict[str, Callable[[EngineGauges], int]] = {
    "kvstrata_leases_active": lambda g: g.leases_active,
    "kvstrata_l1_quarantined_bytes": lambda g: g.quarantined_bytes,
    "kvstrata_writeback_pinned_bytes": lambda g: g.writeback_pinned_bytes,
    "kvstrata_queued_loads": lambda g: g.queued_loads,
}


def _counter_metrics(stats: EngineStats) -> Iterator[Metric]:
    for name, gauge_value in _ENGINE_GAUGES.items():
        gauge = gauge_family(name)
        gauge.add_metric([], gauge_value(stats.gauges))
        yield gauge
    for name, counter_value in _ENGINE_COUNTERS.items():
        family = counter_family(name)
        family.add_metric([], counter_value(stats.counters))
        yield family
    promotions = counter_family("kvstrata_promotions_total")
    for tier, n in stats.counters.promotions_total.items():
        promotions.add_metric([tier], n)
    yield promotions


def _tenant_metrics(stats: EngineStats) -> Iterator[Metric]:
    """Per-tenant families; labels are the config's tenant names and default only."""
    tenants = stats.tenants
    held = gauge_family("kvstrata_tenant_bytes")
    for label in tenants.labels:
        held.add_metric([label, "l1"], tenants.l1_bytes.get(label, 0))
        if tenants.l2_bytes is not None:
            held.add_metric([label, "l2"], tenants.l2_bytes.get(label, 0))
    for label, n in (tenants.shared_bytes or {}).items():  # budgeted tenants only
        held.add_metric([label, "shared"], n)
    yield held
    for name, values in (
        ("kvstrata_tenant_refusals_total", tenants.refusals),
        ("kvstrata_tenant_evictions_total", tenants.evictions),
        ("kvstrata_tenant_expired_total", tenants.expirations),
    ):
        family = counter_family(name)
        for labels, n in values.items():
            family.add_metric(list(labels), n)
        yield family
