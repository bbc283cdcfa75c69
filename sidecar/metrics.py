"""Prometheus metrics of the sidecar.

Why two kinds: request-path figures (lookups, hit tokens, latency, errors)
are counted by the server as it answers; tier and engine figures (bytes,
usage, evictions, queues) are already counted by the engine and its tiers,
so a custom collector reads ``engine.stats()`` at scrape time instead of
copying them on every operation. Everything lives in one
:class:`~prometheus_client.CollectorRegistry` owned by the server (never the
process-global one), served on ``/metrics``.

The names are a contract with the operator's Grafana dashboard; see the
table in the module-level ``METRICS`` list.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from kvstrata.sidecar.engine import EngineStats

logger = logging.getLogger(__name__)

# (name, type, labels, help) of every metric the sidecar exposes.
METRICS: list[tuple[str, str, str, str]] = [
    ("kvstrata_lookups_total", "counter", "", "LOOKUP requests answered"),
    ("kvstrata_lookup_tokens_total", "counter", "", "tokens asked for in lookups"),
    ("kvstrata_hit_tokens_total", "counter", "tier", "tokens found, by the tier holding them"),
    ("kvstrata_stored_bytes_total", "counter", "tier", "bytes written into a tier"),
    ("kvstrata_retrieved_bytes_total", "counter", "tier", "bytes read from a tier"),
    ("kvstrata_operation_duration_seconds", "histogram", "op", "time to answer a request"),
    ("kvstrata_evictions_total", "counter", "tier", "objects evicted"),
    ("kvstrata_tier_usage_bytes", "gauge", "tier", "bytes held"),
    ("kvstrata_tier_capacity_bytes", "gauge", "tier", "bytes a tier may hold"),
    ("kvstrata_tier_objects", "gauge", "tier", "objects held"),
    ("kvstrata_write_queue_depth", "gauge", "tier", "writes waiting for a tier"),
    ("kvstrata_write_queue_dropped_total", "counter", "tier", "writes dropped (queue full)"),
    ("kvstrata_tier_degraded", "gauge", "tier", "1 while a tier is failing"),
    ("kvstrata_corrupt_objects_total", "counter", "tier", "objects refused by their checksum"),
    ("kvstrata_errors_total", "counter", "kind", "request errors by kind"),
    ("kvstrata_clients", "gauge", "", "connected client sessions"),
    ("kvstrata_leases_active", "gauge", "", "arena leases held by clients"),
]

# Latency buckets from 50 us (an L1 lookup) to 10 s (a stalled remote tier).
_BUCKETS = (
    5e-5,
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    1e-2,
    2.5e-2,
    5e-2,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    10.0,
)


class ServerMetrics:
    """The server's own request-path metrics, in a private registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.lookups = Counter("kvstrata_lookups", "LOOKUP requests answered", registry=r)
        self.lookup_tokens = Counter(
            "kvstrata_lookup_tokens", "tokens asked for in lookups", registry=r
        )
        self.hit_tokens = Counter(
            "kvstrata_hit_tokens", "tokens found, by the tier holding them", ["tier"], registry=r
        )
        self.duration = Histogram(
            "kvstrata_operation_duration_seconds",
            "time to answer a request, by op",
            ["op"],
            buckets=_BUCKETS,
            registry=r,
        )
        self.errors = Counter("kvstrata_errors", "request errors by kind", ["kind"], registry=r)
        # Pre-create the common error kinds so dashboards see zeros, not gaps.
        for kind in ("bad_frame", "bad_request", "no_session", "internal"):
            self.errors.labels(kind=kind)

    def expect_tiers(self, tiers: Iterable[str]) -> None:
        """Zero hit counters for every tier the engine has, so a hit rate reads 0
        before the first hit instead of "no data" (a ratio over an absent series)."""
        for tier in tiers:
            self.hit_tokens.labels(tier=tier)

    def count_lookup(self, asked_chunks: int, tiers: list[str], chunk_size: int) -> None:
        self.lookups.inc()
        self.lookup_tokens.inc(asked_chunks * chunk_size)
        per_tier: dict[str, int] = {}
        for tier in tiers:
            per_tier[tier] = per_tier.get(tier, 0) + 1
        for tier, n in per_tier.items():
            self.hit_tokens.labels(tier=tier).inc(n * chunk_size)

    def attach(self, collector: Collector) -> None:
        self.registry.register(collector)


class EngineCollector(Collector):
    """Reads engine and tier counters at scrape time (see the module docstring)."""

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
        clients = GaugeMetricFamily("kvstrata_clients", "connected client sessions")
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
        yield from _counter_metrics(stats.counters)


def _tier_metrics(stats: EngineStats) -> Iterator[Metric]:
    def counter(name: str, doc: str) -> CounterMetricFamily:
        return CounterMetricFamily(name, doc, labels=["tier"])

    def gauge(name: str, doc: str) -> GaugeMetricFamily:
        return GaugeMetricFamily(name, doc, labels=["tier"])

    families: dict[str, tuple[Metric, Callable]] = {
        "stored": (counter("kvstrata_stored_bytes", "bytes written into a tier"),
                   lambda t: t.stored_bytes_total),
        "retrieved": (counter("kvstrata_retrieved_bytes", "bytes read from a tier"),
                      lambda t: t.retrieved_bytes_total),
        "evictions": (counter("kvstrata_evictions", "objects evicted"),
                      lambda t: t.evictions_total),
        "usage": (gauge("kvstrata_tier_usage_bytes", "bytes held"), lambda t: t.usage_bytes),
        "capacity": (gauge("kvstrata_tier_capacity_bytes", "bytes a tier may hold"),
                     lambda t: t.capacity_bytes),
        "objects": (gauge("kvstrata_tier_objects", "objects held"), lambda t: t.objects),
        "depth": (gauge("kvstrata_write_queue_depth", "writes waiting for a tier"),
                  lambda t: t.queue_depth),
        "dropped": (counter("kvstrata_write_queue_dropped", "writes dropped (queue full)"),
                    lambda t: t.dropped_total),
        "degraded": (gauge("kvstrata_tier_degraded", "1 while a tier is failing"),
                     lambda t: 1 if t.degraded else 0),
        "corrupt": (counter("kvstrata_corrupt_objects", "objects refused by their checksum"),
                    lambda t: t.corrupt_total),
    }  # fmt: skip
    tier_errors = CounterMetricFamily(
        "kvstrata_tier_errors", "tier operation failures by kind", labels=["tier", "kind"]
    )
    for name, tier in stats.tiers.items():
        for family, value in families.values():
            family.add_metric([name], value(tier))
        for kind, n in tier.errors_total.items():
            tier_errors.add_metric([name, kind], n)
    for family, _ in families.values():
        yield family
    yield tier_errors


# Engine counters exposed as metrics of their own: counter -> (metric, help).
_ENGINE_COUNTERS = {
    "prefetch_chunks_total": ("kvstrata_prefetch_chunks", "chunks scheduled for prefetch"),
    "leases_expired_total": ("kvstrata_leases_expired", "leases dropped after lease_seconds"),
    "store_rejected_total": ("kvstrata_store_rejected", "chunks refused at PREPARE_STORE"),
    "store_deduplicated_total": (
        "kvstrata_store_deduplicated",
        "chunks not stored again because L1 already held them",
    ),
    "promotion_failed_total": ("kvstrata_promotion_failures", "promotions into L1 that failed"),
    "writeback_skipped_total": (
        "kvstrata_writeback_skipped",
        "chunks not written below L1 (evicted before their write-behind)",
    ),
}


def _counter_metrics(counters: dict[str, int]) -> Iterator[Metric]:
    leases = GaugeMetricFamily("kvstrata_leases_active", "arena leases held by clients")
    leases.add_metric([], counters.get("leases_active", 0))
    yield leases
    if "writeback_pinned_bytes" in counters:
        pinned = GaugeMetricFamily(
            "kvstrata_writeback_pinned_bytes", "L1 bytes pinned until their write-behind ends"
        )
        pinned.add_metric([], counters["writeback_pinned_bytes"])
        yield pinned
    for key, (name, doc) in _ENGINE_COUNTERS.items():
        if key in counters:
            family = CounterMetricFamily(name, doc)
            family.add_metric([], counters[key])
            yield family
    promotions = CounterMetricFamily(
        "kvstrata_promotions", "chunks promoted into L1, by source tier", labels=["tier"]
    )
    for key, value in counters.items():
        if key.startswith("promotions_total_"):
            promotions.add_metric([key[len("promotions_total_") :]], value)
    yield promotions
