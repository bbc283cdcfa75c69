"""Prometheus metrics of the operator: reconciles, admissions, managed Valkey, S3 sweeps.

Why a module of its own: handlers stay thin (they call one ``record_*``
function each) and the names are a contract with the chart's ServiceMonitor
and the dashboard's operator row, kept in one catalogue like the sidecar's
(:data:`CATALOGUE`, rendered into ``docs/metrics.md``). Everything lives in
one private :class:`~prometheus_client.CollectorRegistry`, served on
``--metrics-port`` by :func:`serve`; the handlers find it in kopf's memo.

Label values are bounded: reconcile outcomes and admission results are
small fixed sets, skip reasons are codes (the free-text reason goes to the
pod's annotation and an Event, never into a label), and per-KVCache series
(managed Valkey readiness, S3 sweeps) are removed when the KVCache is deleted.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvstrata.sidecar.metrics import MetricSpec, catalogue_table

if TYPE_CHECKING:
    from kvstrata.operator.reconcile import Outcome
    from kvstrata.operator.s3bounds import Sweep

ReconcileOutcome = Literal["ready", "progressing", "invalid", "error"]
AdmissionResult = Literal["injected", "skipped"]

RECONCILE_OUTCOMES: tuple[str, ...] = ("ready", "progressing", "invalid", "error")
# Why a pod that asked for a cache got none (kvstrata.io/injection-skipped says more).
SKIP_REASONS: tuple[str, ...] = (
    "bad_annotation",
    "kvcache_not_found",
    "invalid_spec",
    "no_vllm_container",
    "already_configured",
    "api_error",
    "unsupported_cluster",  # API server below the native-sidecar floor, or its version unread
    "internal_error",  # the webhook failed; the operator's log has the traceback
    "other",
)

CATALOGUE: tuple[MetricSpec, ...] = (
    MetricSpec("kvstrata_operator_reconciles_total", "counter", ("outcome",), "reconciles",
               "KVCache reconcile passes by outcome (ready, progressing, invalid, error)"),
    MetricSpec("kvstrata_operator_reconcile_duration_seconds", "histogram", (), "seconds",
               "time of one KVCache reconcile pass"),
    MetricSpec("kvstrata_operator_admissions_total", "counter", ("result", "reason"), "pods",
               "pods that asked for a cache, by what the admission webhook did: injected, or "
               "skipped with a reason code"),
    MetricSpec("kvstrata_operator_admission_duration_seconds", "histogram", (), "seconds",
               "time to answer one admission request"),
    MetricSpec("kvstrata_operator_managed_valkey_ready", "gauge",
               ("kvcache_namespace", "kvcache"), "boolean",
               "1 while a KVCache's operator-managed Valkey answers, else 0", from_start=False),
    MetricSpec("kvstrata_operator_s3_swept_objects_total", "counter",
               ("kvcache_namespace", "kvcache"), "objects",
               "objects the size sweeper deleted from a KVCache's S3 prefix (spec.shared.s3."
               "maxSize), least recently written or refreshed first", from_start=False),
    MetricSpec("kvstrata_operator_s3_swept_bytes_total", "counter",
               ("kvcache_namespace", "kvcache"), "bytes",
               "bytes of those objects", from_start=False),
    MetricSpec("kvstrata_operator_s3_prefix_bytes", "gauge",
               ("kvcache_namespace", "kvcache"), "bytes",
               "bytes under a KVCache's S3 prefix after the last sweep", from_start=False),
)  # fmt: skip

_SPECS = {spec.name: spec for spec in CATALOGUE}

__all__ = ["CATALOGUE", "OperatorMetrics", "catalogue_table", "observe_outcome", "serve"]

# From a webhook answer (~1 ms) to a reconcile that waits on the API server (seconds).
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def _help(name: str) -> tuple[str, str, list[str]]:
    spec = _SPECS[name]
    return spec.name, spec.help, list(spec.labels)


class OperatorMetrics:
    """The operator's metrics, in a private registry (one per operator process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.reconciles = Counter(*_help("kvstrata_operator_reconciles_total"), registry=r)
        self.reconcile_duration = Histogram(
            *_help("kvstrata_operator_reconcile_duration_seconds"), buckets=_BUCKETS, registry=r
        )
        self.admissions = Counter(*_help("kvstrata_operator_admissions_total"), registry=r)
        self.admission_duration = Histogram(
            *_help("kvstrata_operator_admission_duration_seconds"), buckets=_BUCKETS, registry=r
        )
        self.valkey_ready = Gauge(*_help("kvstrata_operator_managed_valkey_ready"), registry=r)
        self.s3_swept_objects = Counter(
            *_help("kvstrata_operator_s3_swept_objects_total"), registry=r
        )
        self.s3_swept_bytes = Counter(*_help("kvstrata_operator_s3_swept_bytes_total"), registry=r)
        self.s3_prefix_bytes = Gauge(*_help("kvstrata_operator_s3_prefix_bytes"), registry=r)
        # Zeros from the start, so rates and ratios never read "no data".
        for outcome in RECONCILE_OUTCOMES:
            self.reconciles.labels(outcome=outcome)
        self.admissions.labels(result="injected", reason="")
        for reason in SKIP_REASONS:
            self.admissions.labels(result="skipped", reason=reason)

    def record_reconcile(self, outcome: ReconcileOutcome, seconds: float) -> None:
        self.reconciles.labels(outcome=outcome).inc()
        self.reconcile_duration.observe(seconds)

    def record_admission(self, result: AdmissionResult, reason: str, seconds: float) -> None:
        if result == "skipped" and reason not in SKIP_REASONS:
            reason = "other"
        self.admissions.labels(result=result, reason=reason if result == "skipped" else "").inc()
        self.admission_duration.observe(seconds)

    def set_valkey_ready(self, namespace: str, name: str, ready: bool | None) -> None:
        """``ready`` None: the KVCache has no managed Valkey (any series is removed)."""
        if ready is None:
            with contextlib.suppress(KeyError):  # never set: nothing to remove
                self.valkey_ready.remove(namespace, name)
            return
        self.valkey_ready.labels(kvcache_namespace=namespace, kvcache=name).set(1 if ready else 0)

    def record_sweep(self, namespace: str, name: str, swept: Sweep) -> None:
        labels = {"kvcache_namespace": namespace, "kvcache": name}
        self.s3_swept_objects.labels(**labels).inc(swept.deleted_objects)
        self.s3_swept_bytes.labels(**labels).inc(swept.deleted_bytes)
        self.s3_prefix_bytes.labels(**labels).set(swept.bytes - swept.deleted_bytes)

    def forget_kvcache(self, namespace: str, name: str) -> None:
        """Drop every per-KVCache series of a deleted KVCache."""
        self.set_valkey_ready(namespace, name, None)
        for family in (self.s3_swept_objects, self.s3_swept_bytes, self.s3_prefix_bytes):
            with contextlib.suppress(KeyError):  # never set: nothing to remove
                family.remove(namespace, name)


def observe_outcome(
    metrics: OperatorMetrics, meta: dict[str, Any], outcome: Outcome, started: float
) -> None:
    """Count one reconcile pass by its outcome, and the managed Valkey's readiness."""
    if outcome.permanent:
        kind: ReconcileOutcome = "invalid"
    elif outcome.retry_after is not None:
        kind = "progressing"
    else:
        kind = "ready"
    metrics.record_reconcile(kind, time.perf_counter() - started)
    namespace, name = meta.get("namespace") or "default", meta.get("name") or ""
    if outcome.s3_sweep is not None:
        metrics.record_sweep(namespace, name, outcome.s3_sweep)
    if outcome.status.get("sharedTier") != "valkey-managed":
        metrics.set_valkey_ready(namespace, name, None)
        return
    conditions = outcome.status.get("conditions") or []
    tier = next((c for c in conditions if c.get("type") == "SharedTierReady"), {})
    metrics.set_valkey_ready(namespace, name, tier.get("status") == "True")


def serve(metrics: OperatorMetrics, host: str, port: int) -> Callable[[], None]:
    """Serve ``/metrics`` on ``host:port`` in a daemon thread; returns a stop function."""
    from prometheus_client import start_http_server

    server, thread = start_http_server(port, addr=host, registry=metrics.registry)

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(5)

    return stop
