"""AdmissionReviews through kopf's own admission engine, with our registered handlers.

This is the path a real API server's request takes inside the operator
(after TLS, which test_webhook_tls covers): kopf finds the handler by
resource and annotation filter, runs it, and encodes the JSON patch.
It uses kopf's engine entry point directly; the cluster-side pieces (the
KVCache lookup, events) go to an in-memory cluster.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import json

import jsonpatch
import kopf
from kopf._cogs.structs import references
from kopf._core.engines import admission, indexing
from kopf._core.reactor import inventory

from kvstrata.operator import handlers
from kvstrata.operator import spec as S
from kvstrata.operator.mutate import mutate_pod

from .events import record_events


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


def serve(request: dict, memo: kopf.Memo) -> dict:
    registry = kopf.OperatorRegistry()
    handlers.register(registry)
    insights = references.Insights()
    pods = references.Resource(group="", version="v1", plural="pods", kind="Pod", namespaced=True)
    insights.webhook_resources.add(pods)
    call = admission.serve_admission_request(
        request,
        webhook=handlers.WEBHOOK_ID,
        settings=kopf.OperatorSettings(),
        memories=inventory.ResourceMemories(),
        memobase=memo,
        registry=registry,
        insights=insights,
        indices=indexing.OperatorIndexers().indices,
    )
    return asyncio.run(call)["response"]


def test_kopf_answers_an_annotated_pod_with_the_injection_patch(make_pod, make_kvcache, cluster):
    cluster.put(make_kvcache())
    events: list[dict] = []
    memo = kopf.Memo(cluster=cluster)
    record_events(events)
    pod = make_pod({S.CACHE_ANNOTATION: "demo"})
    response = serve(review(pod), memo)
    assert response["allowed"] is True and response["uid"] == "req-1"
    assert response["patchType"] == "JSONPatch"
    ops = json.loads(base64.b64decode(response["patch"]))
    expected = jsonpatch.apply_patch(pod, mutate_pod(pod, make_kvcache()).patch)
    assert jsonpatch.apply_patch(pod, ops) == expected
    assert events == []


def test_kopf_admits_an_unannotated_pod_without_a_patch(make_pod, cluster):
    response = serve(review(make_pod()), kopf.Memo(cluster=cluster))
    assert response["allowed"] is True
    assert "patch" not in response


def test_kopf_admits_a_pod_whose_cache_is_missing_with_only_the_reason(make_pod, cluster):
    events: list[dict] = []
    memo = kopf.Memo(cluster=cluster)
    record_events(events)
    pod = make_pod({S.CACHE_ANNOTATION: "absent"})
    response = serve(review(pod), memo)
    assert response["allowed"] is True
    ops = json.loads(base64.b64decode(response["patch"]))
    out = jsonpatch.apply_patch(pod, ops)
    assert out["metadata"]["annotations"][S.SKIPPED_ANNOTATION] == "KVCache ml/absent not found"
    assert out["spec"] == pod["spec"]
    assert [e["reason"] for e in events] == ["InjectionSkipped"]
