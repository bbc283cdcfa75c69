"""Prometheus metrics of the sidecar.

Why two kinds: request-path figures (lookups, hit tokens, latency, errors)
are counted by the server as it answers; tier and engine figures (bytes,
usage, evictions, queues) are already counted by the engine and its tiers,
so a custom collector (:mod:`.engine_metrics`) reads ``engine.stats()`` at
scrape time instead of copying them on every operation. This module holds
the catalogue of every metric and the collectors of the server's own state. Everything lives in one
:class:`~prometheus_client.CollectorRegistry` owned by the server (never the
process-global one), served on ``/metrics``.

The names are a contract with the operator's Grafana dashboard; see the
table in the module-level ``METRICS`` list.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from kvstrata.sidecar.fdbudget import ListenerCounts

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MetricSpec:
    """One metric as ``/metrics`` exposes it: the catalogue's row."""

    name: str  # the exposed name (counters end in _total)
    type: Literal["counter", "gauge", "histogram"]
    labels: tuple[str, ...]
    unit: str  # what one unit of the value is (base units: bytes, seconds)
    help: str
    # False where label values are only known when they happen (an exception's
    # kind, a promotion's source tier): the series appear with their first event.
    from_start: bool = True


# Every metric the sidecar exposes. The help texts on /metrics come from here,
# and docs/metrics.md is rendered from it (kvstrata.metricsdoc); a test checks a
# live /metrics against it, so a metric cannot be added or renamed silently.
CATALOGUE: tuple[MetricSpec, ...] = (
    MetricSpec("kvstrata_lookups_total", "counter", (), "requests", "LOOKUP requests answered"),
    MetricSpec("kvstrata_lookup_tokens_total", "counter", (), "tokens",
               "tokens asked for in lookups (the hit rate's denominator)"),
    MetricSpec("kvstrata_hit_tokens_total", "counter", ("tier",), "tokens",
               "tokens found in whole chunks at lookup, by the tier holding them (a partial "
               "chunk's blocks are not counted: vLLM's vllm:kvstrata_hit_tokens_total, which "
               "counts the tokens it loads, includes them)"),
    MetricSpec("kvstrata_tier_lookup_tokens_total", "counter", ("tier",), "tokens",
               "tokens a lookup consulted a tier for (not in a faster tier, before the first "
               "chunk no tier holds): a tier's hit rate is its hit tokens over this"),
    MetricSpec("kvstrata_operation_duration_seconds", "histogram", ("op",), "seconds",
               "time to answer a request, by protocol op (HELLO, LOOKUP, ...)"),
    MetricSpec("kvstrata_errors_total", "counter", ("kind",), "requests",
               "request errors by kind (protocol error codes, recv, send, stats)"),
    MetricSpec("kvstrata_clients", "gauge", (), "sessions", "connected client sessions"),
    MetricSpec("kvstrata_start_time_seconds", "gauge", (), "seconds",
               "when this sidecar process started, Unix time (changes at each restart: "
               "the restart-loop alert counts its changes)"),
    MetricSpec("kvstrata_stored_bytes_total", "counter", ("tier",), "bytes",
               "bytes written into a tier"),
    MetricSpec("kvstrata_retrieved_bytes_total", "counter", ("tier",), "bytes",
               "bytes read from a tier"),
    MetricSpec("kvstrata_evictions_total", "counter", ("tier",), "objects", "objects evicted"),
    MetricSpec("kvstrata_young_evictions_total", "counter", ("tier",), "objects",
               "objects evicted from L1 or L2 less than young_eviction_seconds after they were "
               "stored: the cache is thrashing (the autoscaling signal; 0 for a shared tier)"),
    MetricSpec("kvstrata_l1_free_bytes", "gauge", (), "bytes",
               "L1 arena bytes not held by any chunk (capacity less usage)"),
    MetricSpec("kvstrata_queued_loads", "gauge", (), "chunks",
               "chunks a lookup's prefetch is still loading into L1 from a lower tier"),
    MetricSpec("kvstrata_tier_usage_bytes", "gauge", ("tier",), "bytes", "bytes held"),
    MetricSpec("kvstrata_tier_capacity_bytes", "gauge", ("tier",), "bytes",
               "bytes a tier may hold (0: unbounded, as a shared tier)"),
    MetricSpec("kvstrata_tier_objects", "gauge", ("tier",), "objects", "objects held"),
    MetricSpec("kvstrata_write_queue_depth", "gauge", ("tier",), "writes",
               "writes waiting for a tier"),
    MetricSpec("kvstrata_write_queue_dropped_total", "counter", ("tier",), "writes",
               "writes dropped (queue full)"),
    MetricSpec("kvstrata_tier_degraded", "gauge", ("tier",), "boolean",
               "1 while a tier is failing (a shared tier's circuit breaker is not closed)"),
    MetricSpec("kvstrata_tier_breaker_state", "gauge", ("tier", "state"), "boolean",
               "a shared tier's circuit breaker: 1 for its current state (closed, open, "
               "half_open), 0 for the others", from_start=False),
    MetricSpec("kvstrata_tier_breaker_opened_total", "counter", ("tier",), "events",
               "times a shared tier's circuit breaker opened", from_start=False),
    MetricSpec("kvstrata_tier_expired_total", "counter", ("tier",), "objects",
               "objects a read found past their tenant's ttl_seconds, each a miss and "
               "deleted (S3, whose objects carry their expiry; 0 elsewhere)"),
    MetricSpec("kvstrata_tier_refreshed_total", "counter", ("tier",), "objects",
               "objects a read found near expiry and copied onto themselves to keep them "
               "(S3 with refresh_after_seconds; 0 elsewhere)"),
    MetricSpec("kvstrata_tier_refresh_dropped_total", "counter", ("tier",), "objects",
               "refreshes dropped because refresh_queue_depth were already waiting"),
    MetricSpec("kvstrata_tier_lookup_gets_used_total", "counter", ("tier",), "responses",
               "GET responses a lookup opened whose bodies a fetch then read instead of "
               "sending a request of its own (S3 with prefetch; 0 elsewhere)"),
    MetricSpec("kvstrata_tier_lookup_gets_closed_total", "counter", ("tier",), "responses",
               "GET responses a lookup opened that were closed unread (held past "
               "timeout_seconds, beyond the held cap, or after the prompt's first missing "
               "chunk), each dropping its connection"),
    MetricSpec("kvstrata_tier_server_evicted_keys", "gauge", ("tier",), "keys",
               "the shared server's own count of keys it evicted for maxmemory (Valkey INFO "
               "stats evicted_keys, read at scrape; all KVCaches on that server; resets "
               "when the server restarts)", from_start=False),
    MetricSpec("kvstrata_corrupt_objects_total", "counter", ("tier",), "objects",
               "objects refused by their checksum"),
    MetricSpec("kvstrata_tier_errors_total", "counter", ("tier", "kind"), "operations",
               "tier operation failures by kind", from_start=False),
    MetricSpec("kvstrata_encryption_keys", "gauge", (), "keys",
               "encryption keys loaded from encryption.key_dir (0 with encryption off)"),
    MetricSpec("kvstrata_encryption_key_reloads_total", "counter", (), "reloads",
               "times the key folder changed and was loaded again (a rotation reaching the pod)"),
    MetricSpec("kvstrata_encryption_key_reload_failures_total", "counter", (), "reloads",
               "changes of the key folder that did not parse; the keys loaded before are kept"),
    MetricSpec("kvstrata_decrypt_failures_total", "counter", ("tier", "reason"), "objects",
               "objects not served by encryption at rest, each a miss: unknown_key (sealed "
               "under a key this sidecar does not hold), auth_failed (tag mismatch: tampered, "
               "moved or wrong key), no_key (sealed, encryption off here), plaintext (where "
               "encryption is required)", from_start=False),
    MetricSpec("kvstrata_leases_active", "gauge", (), "leases", "arena leases held by clients"),
    MetricSpec("kvstrata_l1_quarantined_bytes", "gauge", (), "bytes",
               "L1 bytes of expired write leases whose writer may still be writing: kept "
               "pinned until it commits, releases or its session ends, and counted against "
               "that session's write budget"),
    MetricSpec("kvstrata_writeback_pinned_bytes", "gauge", (), "bytes",
               "L1 bytes pinned until their write-behind ends"),
    MetricSpec("kvstrata_prefetch_chunks_total", "counter", (), "chunks",
               "chunks scheduled for prefetch"),
    MetricSpec("kvstrata_prefetched_bytes_total", "counter", (), "bytes",
               "bytes a lookup's prefetch pinned in L1 ahead of the read that follows (that "
               "read is counted in kvstrata_retrieved_bytes_total, the prefetch only here)"),
    MetricSpec("kvstrata_leases_expired_total", "counter", (), "leases",
               "leases dropped after lease_seconds"),
    MetricSpec("kvstrata_store_rejected_total", "counter", (), "chunks",
               "chunks refused at PREPARE_STORE"),
    MetricSpec("kvstrata_store_deduplicated_total", "counter", (), "chunks",
               "chunks not stored again because L1 or L2 already held them"),
    MetricSpec("kvstrata_shared_already_held_total", "counter", (), "chunks",
               "uploads that found the shared tier already holding the key (its first "
               "writer's bytes are kept): this sidecar's L1 and L2 copies were dropped, so "
               "every tier answers the key with the same bytes"),
    MetricSpec("kvstrata_promotion_failures_total", "counter", (), "chunks",
               "promotions into L1 that failed"),
    MetricSpec("kvstrata_writeback_skipped_total", "counter", (), "chunks",
               "chunks not written below L1 (evicted before their write-behind)"),
    MetricSpec("kvstrata_promotions_total", "counter", ("tier",), "chunks",
               "chunks promoted into L1, by source tier", from_start=False),
    MetricSpec("kvstrata_partial_stored_total", "counter", (), "chunks",
               "partial chunks (a prompt's full blocks after its last full chunk) stored"),
    MetricSpec("kvstrata_partial_replaced_total", "counter", (), "chunks",
               "partial chunks removed because a longer partial of the same prefix was stored"),
    MetricSpec("kvstrata_partial_dropped_total", "counter", (), "chunks",
               "partial chunks removed because the full chunk covering them was stored"),
    MetricSpec("kvstrata_partial_hits_total", "counter", (), "lookups",
               "lookups that found a partial chunk after the full prefix"),
    MetricSpec("kvstrata_partial_superseded_deleted_total", "counter", (), "chunks",
               "partial chunk keys deleted from the shared tier once the chunk superseding "
               "them was written there (absent keys included)"),
    MetricSpec("kvstrata_partial_mismatch_total", "counter", (), "chunks",
               "reads refused because the object's block count was not the one expected"),
    MetricSpec("kvstrata_ipc_copy_failures_total", "counter", ("op",), "calls",
               "ipc-mode GPU copies that failed (op: save or load; the chunks are dropped "
               "or missed)"),
    MetricSpec("kvstrata_ipc_copies_expired_total", "counter", ("op",), "calls",
               "SAVE_BLOCKS / LOAD_BLOCKS abandoned because the client's deadline passed "
               "before the copy could start (op: save or load; no block was touched)"),
    MetricSpec("kvstrata_ipc_staging_fallbacks_total", "counter", (), "calls",
               "staging copies that ran zero-copy because one chunk exceeds the staging buffer"),
    MetricSpec("kvstrata_ipc_gpu_faulted", "gauge", (), "boolean",
               "1 after a CUDA error that breaks the sidecar's GPU context: ipc sessions end "
               "and their workers re-connect in host mode until a restart (the pod stays "
               "ready; /status says gpu_fault)"),
    MetricSpec("kvstrata_connections_open", "gauge", ("listener",), "connections",
               "connections open on the HTTP port (http), the liveness socket (liveness) or "
               "the ZeroMQ endpoint (zmq)"),
    MetricSpec("kvstrata_connections_limit", "gauge", ("listener",), "connections",
               "a listener's connection cap, from the descriptors free (at start, and again "
               "when the descriptor limit changes)"),
    MetricSpec("kvstrata_connections_closed_total", "counter", ("listener", "reason"),
               "connections", "connections the sidecar closed: refused (at the cap, none "
               "idle), made_room (idle, closed for a newcomer), idle (past its deadline), "
               "no_descriptor (dropped by the accept guard when an accept found no free file "
               "descriptor; the peer sees the connection end)"),
    MetricSpec("kvstrata_accept_errors_total", "counter", ("listener",), "accepts",
               "accepts that failed for want of file descriptors (each pauses accepting)"),
    MetricSpec("kvstrata_accept_pauses_total", "counter", ("listener",), "events",
               "times the ZeroMQ endpoint (zmq) stopped accepting connections, at its cap or "
               "short of file descriptors, until some closed (its socket file is absent "
               "meanwhile); 0 for the others"),
    MetricSpec("kvstrata_queued_reply_bytes", "gauge", (), "bytes",
               "bytes of replies (those of 4 KiB or more) waiting for clients to take them; "
               "each client's share is bounded by server.max_queued_reply_bytes"),
    MetricSpec("kvstrata_client_bound_refusals_total", "counter", ("bound",), "events",
               "refusals at a per-client bound: sessions_per_peer, sessions_per_uid (a HELLO "
               "refused), queued_reply_bytes (a reply dropped for a short busy error: its "
               "client left server.max_queued_reply_bytes of replies unread)"),
    MetricSpec("kvstrata_tenant_bytes", "gauge", ("tenant", "tier"), "bytes",
               "bytes of a tenant's chunks held in a tier (l1, l2; shared: what the Valkey "
               "ledger of a tenant with budgets.shared_bytes counts, all sidecars together); "
               "tenant: a configured tenant's name, or default"),
    MetricSpec("kvstrata_tenant_refusals_total", "counter", ("tenant", "tier", "reason"),
               "chunks", "stores of a tenant refused: budget (larger than its budget, or "
               "its own chunks are all in use; tier shared: its budgets.shared_bytes, all "
               "sidecars together, is full until some of its objects expire), pinned_budget "
               "(a pinned tenant at its budget), not_kept (a budget of 0)", from_start=False),
    MetricSpec("kvstrata_tenant_evictions_total", "counter", ("tenant", "tier"), "chunks",
               "chunks of a tenant evicted to make room (by its own budget or the tier's "
               "size)", from_start=False),
    MetricSpec("kvstrata_tenant_expired_total", "counter", ("tenant", "tier"), "chunks",
               "chunks of a tenant removed for being older than its ttl_seconds",
               from_start=False),
)  # fmt: skip

# The per-client bounds whose refusals are counted (kvstrata_client_bound_refusals_total).
CLIENT_BOUNDS = ("sessions_per_peer", "sessions_per_uid", "queued_reply_bytes")

SPECS: dict[str, MetricSpec] = {spec.name: spec for spec in CATALOGUE}

# (name, type, labels, help) of every metric with series from the start.
METRICS: list[tuple[str, str, str, str]] = [
    (m.name, m.type, ",".join(m.labels), m.help) for m in CATALOGUE if m.from_start
]


def catalogue_table(catalogue: Iterable[MetricSpec]) -> list[str]:
    """Markdown table rows of a catalogue (the sidecar's, or another's in this shape)."""
    lines = ["| name | type | labels | unit | meaning |", "| --- | --- | --- | --- | --- |"]
    for m in catalogue:
        labels = ", ".join(f"`{label}`" for label in m.labels) or "-"
        mark = "" if m.from_start else " *"
        lines.append(f"| `{m.name}`{mark} | {m.type} | {labels} | {m.unit} | {m.help} |")
    return lines


def counter_family(name: str) -> CounterMetricFamily:
    spec = SPECS[name]
    return CounterMetricFamily(name, spec.help, labels=list(spec.labels))


def gauge_family(name: str) -> GaugeMetricFamily:
    spec = SPECS[name]
    return GaugeMetricFamily(name, spec.help, labels=list(spec.labels))


# Latency buckets from 50 us (an L1 lookup) to 10 s (a stalled remote tier).
_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5,
            1.0, 2.5, 10.0)  # fmt: skip


class ServerMetrics:
    """The server's own request-path metrics, in a private registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.lookups = _request_counter("kvstrata_lookups_total", r)
        self.lookup_tokens = _request_counter("kvstrata_lookup_tokens_total", r)
        self.hit_tokens = _request_counter("kvstrata_hit_tokens_total", r)
        self.tier_lookup_tokens = _request_counter("kvstrata_tier_lookup_tokens_total", r)
        spec = SPECS["kvstrata_operation_duration_seconds"]
        self.duration = Histogram(
            spec.name, spec.help, list(spec.labels), buckets=_BUCKETS, registry=r
        )
        self.errors = _request_counter("kvstrata_errors_total", r)
        # Pre-create the common error kinds so dashboards see zeros, not gaps.
        for kind in ("bad_frame", "bad_request", "no_session", "forbidden", "internal"):
            self.errors.labels(kind=kind)
        spec = SPECS["kvstrata_start_time_seconds"]
        self.start_time = Gauge(spec.name, spec.help, registry=r)
        self.start_time.set(time.time())
        self.bound_refusals = _request_counter("kvstrata_client_bound_refusals_total", r)
        for bound in CLIENT_BOUNDS:
            self.bound_refusals.labels(bound=bound)

    def expect_tiers(self, tiers: Iterable[str]) -> None:
        """Zero hit counters for every tier the engine has, so a hit rate reads 0
        before the first hit instead of "no data" (a ratio over an absent series)."""
        for tier in tiers:
            self.hit_tokens.labels(tier=tier)
            self.tier_lookup_tokens.labels(tier=tier)

    def count_lookup(
        self,
        asked_chunks: int,
        tiers: list[str],
        chunk_size: int,
        asked_by_tier: dict[str, int] | None = None,
    ) -> None:
        """One LOOKUP: chunks asked, the tier of each hit chunk, and the chunks each
        tier was consulted for (the per-tier denominators)."""
        self.lookups.inc()
        self.lookup_tokens.inc(asked_chunks * chunk_size)
        per_tier: dict[str, int] = {}
        for tier in tiers:
            per_tier[tier] = per_tier.get(tier, 0) + 1
        for tier, n in per_tier.items():
            self.hit_tokens.labels(tier=tier).inc(n * chunk_size)
        for tier, n in (asked_by_tier or {}).items():
            if n:
                self.tier_lookup_tokens.labels(tier=tier).inc(n * chunk_size)

    def attach(self, collector: Collector) -> None:
        self.registry.register(collector)


class ListenerCollector(Collector):
    """Reads the listeners' connection counts at scrape time."""

    def __init__(self, counts: dict[str, ListenerCounts]) -> None:
        self._counts = counts

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        opened = gauge_family("kvstrata_connections_open")
        limit = gauge_family("kvstrata_connections_limit")
        closed = counter_family("kvstrata_connections_closed_total")
        errors = counter_family("kvstrata_accept_errors_total")
        pauses = counter_family("kvstrata_accept_pauses_total")
        dropped = _dropped_by_guard(self._counts)
        for name, c in self._counts.items():
            opened.add_metric([name], c.open)
            limit.add_metric([name], c.limit)
            for reason, n in (("refused", c.refused), ("made_room", c.made_room),
                              ("idle", c.idle_closed),
                              ("no_descriptor", dropped[name])):  # fmt: skip
                closed.add_metric([name, reason], n)
            errors.add_metric([name], c.accept_errors)
            pauses.add_metric([name], c.paused)
        yield from (opened, limit, closed, errors, pauses)


def _dropped_by_guard(counts: dict[str, ListenerCounts]) -> dict[str, int]:
    """Connections the accept guard dropped, per listener: the Python listeners'
    by their listening descriptor, the rest (libzmq's listeners) as zmq's."""
    from kvstrata.sidecar import acceptguard

    out = {
        name: acceptguard.dropped(c.listen_fd) if c.listen_fd >= 0 else 0
        for name, c in counts.items()
        if name != "zmq"
    }
    out["zmq"] = max(0, acceptguard.dropped() - sum(out.values()))
    return out


class QueuedRepliesCollector(Collector):
    """Reads the bytes of replies waiting for their clients at scrape time."""

    def __init__(self, queued_bytes: Callable[[], int]) -> None:
        self._queued_bytes = queued_bytes

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        queued = gauge_family("kvstrata_queued_reply_bytes")
        queued.add_metric([], self._queued_bytes())
        yield queued


class IpcCollector(Collector):
    """Reads ipc mode's GPU counters at scrape time (from ``IpcTransfers.gpu_stats``)."""

    def __init__(self, gpu_stats: Callable[[], dict[str, Any]]) -> None:
        self._gpu_stats = gpu_stats

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        stats = self._gpu_stats()
        failures = counter_family("kvstrata_ipc_copy_failures_total")
        for op in ("save", "load"):
            failures.add_metric([op], stats["copy_failures"].get(op, 0))
        yield failures
        expired = counter_family("kvstrata_ipc_copies_expired_total")
        for op in ("save", "load"):
            expired.add_metric([op], stats.get("expired", {}).get(op, 0))
        yield expired
        fallbacks = counter_family("kvstrata_ipc_staging_fallbacks_total")
        fallbacks.add_metric([], stats["staging_fallbacks"])
        yield fallbacks
        faulted = gauge_family("kvstrata_ipc_gpu_faulted")
        faulted.add_metric([], 1 if stats["fault"] else 0)
        yield faulted


def _request_counter(name: str, registry: CollectorRegistry) -> Counter:
    spec = SPECS[name]
    return Counter(name, spec.help, list(spec.labels), registry=registry)
