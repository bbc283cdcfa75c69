"""The operator's metrics: what the handlers count, served on a real HTTP port.

Handlers run as kopf calls them (a kopf Body and Patch, an in-memory cluster);
the counts are read back from the operator's own ``/metrics`` over HTTP.
"""

from __future__ import annotations

import types
import urllib.request

import kopf
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvstrata.operator import handlers
from kvstrata.operator import spec as S
from kvstrata.operator.metrics import CATALOGUE, OperatorMetrics, serve
from kvstrata.testing.servers import free_port

MANAGED = {"backend": "valkey", "valkey": {"managed": {"replicas": 2}}}


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@pytest.fixture
def served() -> tuple[OperatorMetrics, int]:
    metrics, port = OperatorMetrics(), free_port()
    stop = serve(metrics, "127.0.0.1", port)
    yield metrics, port
    stop()


def kwargs(kvcache: dict, cluster, metrics: OperatorMetrics) -> dict:
    body = kopf.Body(kvcache)
    memo = types.SimpleNamespace(cluster=cluster, metrics=metrics)
    return {"body": body, "patch": kopf.Patch(body=body), "memo": memo, "logger": handlers.logger}


def test_reconciles_are_counted_by_outcome_with_the_managed_valkey_readiness(
    served, make_kvcache, cluster
):
    metrics, port = served
    handlers.reconcile_kvcache(**kwargs(make_kvcache("plain"), cluster, metrics))
    starting = make_kvcache("cache", shared=MANAGED)
    with pytest.raises(kopf.TemporaryError):
        handlers.reconcile_kvcache(**kwargs(starting, cluster, metrics))
    with pytest.raises(kopf.PermanentError):
        handlers.reconcile_kvcache(
            **kwargs(make_kvcache("bad", l1={"policy": "mru"}), cluster, metrics)
        )
    got = scrape(port)
    for outcome, n in (("ready", 1), ("progressing", 1), ("invalid", 1), ("error", 0)):
        assert got[("kvstrata_operator_reconciles_total", (("outcome", outcome),))] == n, outcome
    assert got[("kvstrata_operator_reconcile_duration_seconds_count", ())] == 3
    ready = (
        "kvstrata_operator_managed_valkey_ready",
        (("kvcache", "cache"), ("kvcache_namespace", "ml")),
    )
    assert got[ready] == 0

    sts = cluster.objects[("apps/v1", "StatefulSet", "ml", "cache-valkey")]
    sts["status"] = {"readyReplicas": 2}
    handlers.recheck_kvcache(**kwargs(starting, cluster, metrics))
    assert scrape(port)[ready] == 1
    handlers.forget_kvcache(**kwargs(starting, cluster, metrics))
    assert ready not in scrape(port), "a deleted KVCache leaves no series behind"


def test_a_reconcile_that_raises_is_counted_as_an_error(served, make_kvcache):
    metrics, port = served

    class BrokenCluster:  # a fault the in-memory cluster cannot cause: the API server fails
        def __getattr__(self, name: str):
            raise RuntimeError("the API server is gone")

    with pytest.raises(RuntimeError):
        handlers.reconcile_kvcache(**kwargs(make_kvcache(), BrokenCluster(), metrics))
    assert scrape(port)[("kvstrata_operator_reconciles_total", (("outcome", "error"),))] == 1


def test_admissions_are_counted_injected_or_skipped_with_a_reason_code(
    served, make_kvcache, make_pod, cluster
):
    metrics, port = served
    cluster.put(make_kvcache())
    for pod in (
        make_pod({S.CACHE_ANNOTATION: "demo"}),  # injected
        make_pod({S.CACHE_ANNOTATION: "nowhere"}),  # no such KVCache
        make_pod({S.CACHE_ANNOTATION: "Not_A_Name"}),  # not a KVCache name
    ):
        handlers.inject_sidecar(**kwargs(pod, cluster, metrics))
    got = scrape(port)
    key = "kvstrata_operator_admissions_total"
    assert got[(key, (("reason", ""), ("result", "injected")))] == 1
    assert got[(key, (("reason", "kvcache_not_found"), ("result", "skipped")))] == 1
    assert got[(key, (("reason", "bad_annotation"), ("result", "skipped")))] == 1
    assert got[(key, (("reason", "invalid_spec"), ("result", "skipped")))] == 0
    assert got[("kvstrata_operator_admission_duration_seconds_count", ())] == 3


def test_the_metrics_port_serves_the_catalogue_and_no_more(served):
    metrics, port = served
    metrics.set_valkey_ready("ml", "demo", True)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        families = list(text_string_to_metric_families(reply.read().decode()))
    served_names = {
        f"{f.name}_total" if f.type == "counter" else f.name
        for f in families
        if not f.name.endswith("_created")
    }
    assert served_names == {m.name for m in CATALOGUE}
