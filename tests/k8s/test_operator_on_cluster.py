"""The real operator against a real cluster: reconcile, owned objects, the webhook, cleanup."""

from __future__ import annotations

import uuid

import pytest

from kvstrata.operator import spec as S

pytestmark = [pytest.mark.k8s, pytest.mark.slow]


def kvcache(name: str, namespace: str, **spec) -> dict:
    return {
        "apiVersion": S.API_VERSION,
        "kind": S.KIND,
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"l1": {"size": "64Mi"}, "l2": {"size": "256Mi"}, **spec},
    }


def pod(name: str, namespace: str, annotations: dict[str, str]) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "annotations": annotations},
        "spec": {
            "containers": [
                {
                    "name": "vllm",
                    "image": "registry.invalid/vllm:none",
                    "args": ["vllm", "serve", "m"],
                }
            ]
        },
    }


def condition(obj: dict | None, ctype: str) -> dict:
    conditions = ((obj or {}).get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == ctype), {})


def test_the_crd_applies_and_the_api_serves_kvcaches(kube, crd_applied, namespace):
    assert kube.has_kind(S.API_VERSION, S.KIND)
    bad = kvcache("bad", namespace, l1={"policy": "mru"})
    from kubernetes.client.exceptions import ApiException

    with pytest.raises(ApiException) as refused:
        kube.apply(bad)  # the CRD's enum refuses it before any reconcile
    assert refused.value.status == 422


def test_a_kvcache_becomes_ready_with_its_configmap(kube, namespace, operator, wait_for):
    name = f"local-{uuid.uuid4().hex[:4]}"
    kube.apply(kvcache(name, namespace))
    ready = wait_for(
        lambda: (
            condition(kube.get(S.API_VERSION, S.KIND, namespace, name), "Ready").get("status")
            == "True"
        ),
        90,
        f"KVCache {name} to be Ready",
    )
    assert ready
    cm = kube.get("v1", "ConfigMap", namespace, S.configmap_name(name))
    assert "size_bytes: 67108864" in cm["data"]["sidecar.yaml"]
    status = kube.get(S.API_VERSION, S.KIND, namespace, name)["status"]
    assert status["observedGeneration"] == 1 and status["sharedTier"] == "none"


def test_a_managed_valkey_statefulset_appears_and_deletion_removes_what_was_owned(
    kube, namespace, operator, wait_for
):
    name = f"shared-{uuid.uuid4().hex[:4]}"
    kube.apply(kvcache(name, namespace, shared={"backend": "valkey", "valkey": {"managed": {}}}))
    sts = wait_for(
        lambda: kube.get("apps/v1", "StatefulSet", namespace, S.valkey_name(name)),
        90,
        "the managed Valkey StatefulSet",
    )
    assert sts["metadata"]["ownerReferences"][0]["name"] == name
    assert kube.get("v1", "Secret", namespace, S.valkey_auth_secret_name(name)) is not None
    kube.delete(S.API_VERSION, S.KIND, namespace, name)
    wait_for(
        lambda: (
            kube.get("v1", "ConfigMap", namespace, S.configmap_name(name)) is None
            and kube.get("apps/v1", "StatefulSet", namespace, S.valkey_name(name)) is None
        ),
        120,
        "garbage collection of the KVCache's ConfigMap and StatefulSet",
    )


def test_an_annotated_pod_gets_the_sidecar_and_an_unannotated_pod_is_untouched(
    kube, namespace, operator, webhook, wait_for
):
    if webhook is None:
        pytest.skip("KVSTRATA_K8S_WEBHOOK_HOST is not set: the API server cannot reach the webhook")
    name = f"inj-{uuid.uuid4().hex[:4]}"
    kube.apply(kvcache(name, namespace))
    wait_for(lambda: kube.get("v1", "ConfigMap", namespace, S.configmap_name(name)), 90, "config")
    wait_for(lambda: _webhook_answers(kube, namespace), 60, "the webhook to answer")
    kube.apply(pod(f"{name}-a", namespace, {S.CACHE_ANNOTATION: name}))
    injected = kube.get("v1", "Pod", namespace, f"{name}-a")
    inits = {c["name"]: c for c in injected["spec"].get("initContainers") or []}
    assert inits["kvstrata-sidecar"]["restartPolicy"] == "Always"
    assert "--kv-transfer-config" in injected["spec"]["containers"][0]["args"]
    assert injected["metadata"]["labels"][S.CACHE_LABEL] == name
    kube.apply(pod(f"{name}-b", namespace, {}))
    plain = kube.get("v1", "Pod", namespace, f"{name}-b")
    assert not plain["spec"].get("initContainers")
    assert S.SKIPPED_ANNOTATION not in plain["metadata"].get("annotations", {})
    kube.apply(pod(f"{name}-c", namespace, {S.CACHE_ANNOTATION: "no-such-cache"}))
    skipped = kube.get("v1", "Pod", namespace, f"{name}-c")
    assert "not found" in skipped["metadata"]["annotations"][S.SKIPPED_ANNOTATION]


def _webhook_answers(kube, namespace: str) -> bool:
    """Create a probe pod that asks for a missing cache; the webhook marks it when up."""
    probe = f"probe-{uuid.uuid4().hex[:6]}"
    kube.apply(pod(probe, namespace, {S.CACHE_ANNOTATION: "probe-absent"}))
    created = kube.get("v1", "Pod", namespace, probe) or {}
    kube.delete("v1", "Pod", namespace, probe)
    return S.SKIPPED_ANNOTATION in (created.get("metadata") or {}).get("annotations", {})
