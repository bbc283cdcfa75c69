"""AdmissionReviews over HTTP through kopf's own webhook server, with our registered handlers.

This is the path a real API server's request takes inside the operator:
kopf's ``admission_webhook_server`` runs the operator's webhook server class
(:class:`~kvstrata.operator.handlers.NamespacedWebhookServer`, plain HTTP
here; TLS is test_webhook_tls's), kopf's admission engine finds the handler
by resource and annotation filter, runs it and encodes the JSON patch; the
test posts real HTTP requests. The cluster-side pieces (the KVCache lookup,
the server version, Events) go to the in-memory cluster.

The webhook must never deny a pod: kopf denies whenever a handler raises.
Each step that can raise gets a fault double (a stand-in that raises where
the real part would, for a fault that cannot be caused otherwise): reading
the KVCache, reading the server version, rendering, posting the Event,
counting the metric. ``kopf.event`` is kopf's real one in this module, as in
the operator: the webhook must not depend on it (kopf's event queue does not
exist in the admission handler's context, where it raises ``LookupError``).

kopf serves admission publicly only from a whole running operator (which
logs in to a cluster), so this test reaches into kopf's private modules;
constraints.txt pins the kopf version it was written against.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import functools
import json
import logging
import threading
import urllib.request
from collections.abc import Iterator
from typing import Any

import jsonpatch
import kopf
import pytest
from kopf._cogs.aiokits import aiovalues
from kopf._cogs.structs import references
from kopf._core.engines import admission, indexing, posting
from kopf._core.reactor import inventory

from kvstrata.operator import handlers
from kvstrata.operator import spec as S
from kvstrata.operator.mutate import mutate_pod
from kvstrata.testing.poll import wait_until

from .conftest import InMemoryCluster

REAL_KOPF_EVENT = kopf.event  # before the suite's autouse fixture replaces it


@pytest.fixture(autouse=True)
def _kopf_event_is_kopfs_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kopf, "event", REAL_KOPF_EVENT)


def review(pod: dict, operation: str = "CREATE") -> dict:
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "req-1",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "operation": operation,
            "namespace": "ml",
            "userInfo": {"username": "system:serviceaccount:kube-system:replicaset-controller"},
            "object": copy.deepcopy(pod),
        },
    }


class KopfWebhook:
    """kopf's admission webhook server on loopback, in an event loop of its own thread."""

    def __init__(self, memo: kopf.Memo) -> None:
        self.memo = memo
        self.loop = asyncio.new_event_loop()
        self.url = ""

    def start(self) -> None:
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        registry = kopf.OperatorRegistry()
        handlers.register(registry)
        settings = kopf.OperatorSettings()
        settings.admission.server = handlers.NamespacedWebhookServer(
            addr="127.0.0.1", port=None, host="127.0.0.1", insecure=True
        )
        insights = references.Insights()
        pods = references.Resource(
            group="", version="v1", plural="pods", kind="Pod", namespaced=True
        )
        insights.webhook_resources.add(pods)
        insights.ready_resources.set()
        webhookfn = functools.partial(
            admission.serve_admission_request,
            settings=settings,
            memories=inventory.ResourceMemories(),
            memobase=self.memo,
            registry=registry,
            insights=insights,
            indices=indexing.OperatorIndexers().indices,
        )
        container: aiovalues.Container = aiovalues.Container()

        async def operator_context() -> None:
            # What kopf's spawn_tasks sets before it starts the webhook server
            # (kopf/_core/reactor/running.py); its event queue it does not set.
            posting.settings_var.set(settings)
            await admission.admission_webhook_server(
                settings=settings,
                registry=registry,
                insights=insights,
                webhookfn=webhookfn,
                container=container,
            )

        self.task = asyncio.run_coroutine_threadsafe(operator_context(), self.loop)
        config = asyncio.run_coroutine_threadsafe(container.wait(), self.loop).result(30)
        self.url = config["url"].rstrip("/")

    def stop(self) -> None:
        """Cancel the server (it closes its socket) and every task it left, then the loop."""

        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(cancel_all(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.loop.close()

    def post(self, body: dict) -> dict:
        request = urllib.request.Request(
            f"{self.url}/{handlers.WEBHOOK_ID}",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=30) as answer:
            return json.loads(answer.read())["response"]


@pytest.fixture
def serve() -> Iterator[Any]:
    """``serve(pod, memo)``: the AdmissionReview response kopf's server gives over HTTP."""
    servers: list[KopfWebhook] = []

    def run(pod: dict, memo: kopf.Memo) -> dict:
        server = KopfWebhook(memo)
        servers.append(server)
        server.start()
        return server.post(review(pod))

    yield run
    for server in servers:
        server.stop()


def patched(pod: dict, response: dict) -> dict:
    if "patch" not in response:
        return pod
    return jsonpatch.apply_patch(pod, json.loads(base64.b64decode(response["patch"])))


def events_in(cluster: InMemoryCluster) -> list[dict]:
    return [o for (_, kind, _, _), o in cluster.objects.items() if kind == "Event"]


def test_kopf_answers_an_annotated_pod_with_the_injection_patch(
    make_pod, make_kvcache, cluster, serve
):
    cluster.put(make_kvcache())
    pod = make_pod({S.CACHE_ANNOTATION: "demo"})
    response = serve(pod, kopf.Memo(cluster=cluster))
    assert response["allowed"] is True and response["uid"] == "req-1"
    assert response["patchType"] == "JSONPatch"
    expected = jsonpatch.apply_patch(pod, mutate_pod(pod, make_kvcache()).patch)
    assert patched(pod, response) == expected
    assert events_in(cluster) == []


def test_kopf_admits_an_unannotated_pod_without_a_patch(make_pod, cluster, serve):
    response = serve(make_pod(), kopf.Memo(cluster=cluster))
    assert response["allowed"] is True
    assert "patch" not in response


def test_a_pod_whose_cache_is_missing_is_admitted_with_the_reason_and_an_event(
    make_pod, cluster, serve
):
    # The typo case: on a real API server the old handler's kopf.event raised
    # LookupError (event_queue_loop_var) and the pod was denied.
    pod = make_pod({S.CACHE_ANNOTATION: "absent"})
    response = serve(pod, kopf.Memo(cluster=cluster))
    assert response["allowed"] is True, response
    out = patched(pod, response)
    assert out["metadata"]["annotations"][S.SKIPPED_ANNOTATION] == "KVCache ml/absent not found"
    assert out["spec"] == pod["spec"]
    events = wait_until(lambda: events_in(cluster), 30, "the InjectionSkipped Event")
    assert [(e["reason"], e["type"]) for e in events] == [("InjectionSkipped", "Warning")]
    assert events[0]["involvedObject"] == {
        "apiVersion": "v1",
        "kind": "Pod",
        "namespace": "ml",
        "name": "vllm-0",
    }
    assert events[0]["message"] == "KVCache ml/absent not found"


def test_an_old_api_server_gets_the_pod_without_a_sidecar_and_the_reason(
    make_pod, make_kvcache, cluster, serve
):
    cluster.put(make_kvcache())
    cluster.version_info = {"major": "1", "minor": "28", "gitVersion": "v1.28.7"}
    pod = make_pod({S.CACHE_ANNOTATION: "demo"})
    response = serve(pod, kopf.Memo(cluster=cluster))
    assert response["allowed"] is True
    out = patched(pod, response)
    assert out["spec"] == pod["spec"]
    reason = out["metadata"]["annotations"][S.SKIPPED_ANNOTATION]
    assert "v1.28.7" in reason and "1.29 or later" in reason


# -- fault doubles: each step that can raise ------------------------------------------


class FaultyCluster(InMemoryCluster):
    """A cluster double whose ``step`` raises, as a broken API client would."""

    def __init__(self, step: str) -> None:
        super().__init__()
        self.step = step

    def get(self, *args: Any) -> dict | None:
        if self.step == "read-kvcache":
            raise RuntimeError("fault double: reading the KVCache")
        return super().get(*args)

    def server_version(self) -> dict[str, str]:
        if self.step == "server-version":
            raise RuntimeError("fault double: GET /version")
        return super().server_version()

    def apply(self, obj: Any) -> dict:
        if self.step == "post-event" and obj["kind"] == "Event":
            raise RuntimeError("fault double: posting an Event")
        return super().apply(obj)


class FaultyMetrics:
    """An operator-metrics double whose admission counter raises."""

    def __init__(self) -> None:
        self.calls = 0

    def record_admission(self, *args: Any) -> None:
        self.calls += 1
        raise RuntimeError("fault double: the admission metric")


def render_fault(*args: Any, **kwargs: Any) -> Any:
    """A rendering double raising what the renderer does not expect (not a SpecError)."""
    raise KeyError("fault double: rendering")


@pytest.mark.parametrize(
    ("step", "cache", "skip_reason"),
    [
        ("read-kvcache", "demo", "cannot read KVCache ml/demo: fault double: reading the KVCache"),
        ("server-version", "demo", "cannot read the API server's version: fault double"),
        ("render", "demo", "internal error in the kvstrata webhook: KeyError"),
        ("post-event", "absent", "KVCache ml/absent not found"),
        ("metrics", "absent", "KVCache ml/absent not found"),
        ("metrics", "demo", None),
    ],
)
def test_a_fault_at_any_step_still_admits_the_pod(
    step, cache, skip_reason, make_pod, make_kvcache, monkeypatch, caplog, serve
):
    cluster = FaultyCluster(step)
    cluster.put(make_kvcache())
    memo = kopf.Memo(cluster=cluster)
    metrics = FaultyMetrics()
    if step == "metrics":
        memo.metrics = metrics
    if step == "render":
        monkeypatch.setattr(S, "render_sidecar_config", render_fault)
    pod = make_pod({S.CACHE_ANNOTATION: cache})
    with caplog.at_level(logging.INFO, logger="kvstrata.operator"):
        response = serve(pod, memo)
    assert response["allowed"] is True, response
    out = patched(pod, response)
    if skip_reason is None:  # injected; only the metric failed
        assert out == jsonpatch.apply_patch(pod, mutate_pod(pod, make_kvcache()).patch)
    else:
        assert out["spec"] == pod["spec"]  # the pod as it was, but for the reason
        assert out["metadata"]["annotations"][S.SKIPPED_ANNOTATION].startswith(skip_reason)
    if step == "metrics":
        assert metrics.calls == 1
    # The log line naming the fault (the Event is posted after the answer: wait for it).
    wait_until(lambda: "fault double" in caplog.text, 30, f"a log line about the {step} fault")
