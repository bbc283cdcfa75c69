"""The real operator against a real cluster: the CRD, reconcile, status, events, rolling,
garbage collection and the admission webhook.

No test waits for a pod to run: against a control plane without nodes, pods
are created (and mutated by the webhook) but stay Pending.
"""

from __future__ import annotations

import base64
import json
import uuid
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from kvstrata.operator import certs
from kvstrata.operator import encryption as E
from kvstrata.operator import spec as S
from kvstrata.operator.reconcile import reconcile

from .conftest import ADMISSION, REPO, free_port, webhook_configuration

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

READY_TIMEOUT_S = 90


S3_SHARED = {"backend": "s3", "s3": {"bucket": "kv-cache", "credentialsSecretRef": {"name": "s3"}}}


def kvcache(name: str, namespace: str, **spec: Any) -> dict:
    return {
        "apiVersion": S.API_VERSION,
        "kind": S.KIND,
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"l1": {"size": "64Mi"}, "l2": {"size": "256Mi"}, **spec},
    }


def pod(name: str, namespace: str, annotations: dict[str, str], **labels: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "annotations": annotations,
            "labels": labels,
        },
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


def deployment(name: str, namespace: str, cache: str) -> dict:
    labels = {"app": name}
    template = pod(name, namespace, {S.CACHE_ANNOTATION: cache}, **labels)
    del template["metadata"]["name"], template["metadata"]["namespace"]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels},
            "template": {"metadata": template["metadata"], "spec": template["spec"]},
        },
    }


def condition(obj: dict | None, ctype: str) -> dict:
    conditions = ((obj or {}).get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == ctype), {})


def wait_ready(kube, namespace: str, name: str, wait_for, generation: int = 1) -> dict:
    """The KVCache once its status says Ready for ``generation``."""

    def ready() -> dict | None:
        found = kube.get(S.API_VERSION, S.KIND, namespace, name)
        status = (found or {}).get("status") or {}
        ok = condition(found, "Ready")
        if (
            status.get("observedGeneration") == generation
            and ok.get("status") == "True"
            and ok.get("observedGeneration") == generation
        ):
            return found
        return None

    return wait_for(ready, READY_TIMEOUT_S, f"KVCache {name} Ready at generation {generation}")


def resource_versions(kube, namespace: str, name: str) -> dict[str, str]:
    owned = [
        ("v1", "ConfigMap", S.configmap_name(name)),
        ("v1", "Service", S.metrics_service_name(name)),
    ]
    out = {}
    for api_version, kind, obj_name in owned:
        found = kube.get(api_version, kind, namespace, obj_name)
        assert found is not None, f"{kind} {obj_name} was not created"
        out[f"{kind}/{obj_name}"] = found["metadata"]["resourceVersion"]
    return out


# -- the CRD on the API server -----------------------------------------------------


def test_the_crd_applies_and_the_api_server_defaults_and_validates_kvcaches(
    kube, crd_applied, namespace
):
    assert kube.has_kind(S.API_VERSION, S.KIND)
    name = f"defaults-{uuid.uuid4().hex[:4]}"
    stored = kube.apply(
        {
            "apiVersion": S.API_VERSION,
            "kind": S.KIND,
            "metadata": {"name": name, "namespace": namespace},
            "spec": {},
        }
    )
    spec = stored["spec"]
    assert spec["l2"]["volume"] == {"type": "emptyDir"}  # a default inside a default
    assert spec["shared"]["backend"] == "none"
    kube.delete(S.API_VERSION, S.KIND, namespace, name)


@pytest.mark.parametrize(
    ("spec", "refusal"),
    [
        ({"l1": {"policy": "mru"}}, "Unsupported value"),
        ({"l2": {"volume": {"type": "existingClaim"}}}, "l2.volume.claimName is required"),
        ({"shared": {"backend": "s3"}}, "shared.s3 is required"),
        (
            {"shared": {"valkey": {"managed": {}, "external": {"url": "redis://v:6379"}}}},
            "set one of shared.valkey.managed and shared.valkey.external",
        ),
        (
            {"shared": S3_SHARED, "tenants": [{"name": "a", "budgets": {"shared": "0.5Gi"}}]},
            "tenants[].budgets.shared must be 0 or unset when shared.backend is s3",
        ),
    ],
)
def test_the_api_server_refuses_what_the_crd_forbids(kube, namespace, spec, refusal):
    with pytest.raises(ApiException) as refused:
        kube.apply(kvcache(f"bad-{uuid.uuid4().hex[:4]}", namespace, **spec))
    assert refused.value.status == 422
    assert refusal in str(refused.value)


def test_the_api_server_takes_a_zero_shared_budget_on_s3_bare_or_with_a_unit(
    kube, crd_applied, namespace
):
    name = f"zero-{uuid.uuid4().hex[:4]}"
    zeros = ["0", 0, "0Gi", "0k", "0Pi"]
    tenants = [{"name": f"t{i}", "budgets": {"shared": zero}} for i, zero in enumerate(zeros)]
    stored = kube.apply(kvcache(name, namespace, shared=S3_SHARED, tenants=tenants))
    assert [t["budgets"]["shared"] for t in stored["spec"]["tenants"]] == zeros
    kube.delete(S.API_VERSION, S.KIND, namespace, name)


# -- reconcile, status, events -----------------------------------------------------


def test_a_kvcache_becomes_ready_with_its_configmap(kube, namespace, operator, wait_for):
    name = f"local-{uuid.uuid4().hex[:4]}"
    kube.apply(kvcache(name, namespace))
    found = wait_ready(kube, namespace, name, wait_for)
    cm = kube.get("v1", "ConfigMap", namespace, S.configmap_name(name))
    assert "size_bytes: 67108864" in cm["data"]["sidecar.yaml"]
    status = found["status"]
    assert status["sharedTier"] == "none" and status["configMap"] == S.configmap_name(name)
    assert cm["metadata"]["ownerReferences"][0]["uid"] == found["metadata"]["uid"]


def test_a_spec_change_moves_observed_generation_conditions_and_config(
    kube, namespace, operator, wait_for
):
    name = f"gen-{uuid.uuid4().hex[:4]}"
    kube.apply(kvcache(name, namespace))
    first = wait_ready(kube, namespace, name, wait_for, generation=1)
    kube.apply(kvcache(name, namespace, l1={"size": "128Mi"}))
    second = wait_ready(kube, namespace, name, wait_for, generation=2)
    assert second["metadata"]["generation"] == 2
    assert second["status"]["configHash"] != first["status"]["configHash"]
    for ctype in ("Ready", "SharedTierReady", "Degraded"):
        assert condition(second, ctype)["observedGeneration"] == 2, ctype
    assert condition(second, "Degraded")["status"] == "False"
    cm = kube.get("v1", "ConfigMap", namespace, S.configmap_name(name))
    assert "size_bytes: 134217728" in cm["data"]["sidecar.yaml"]


def test_a_second_reconcile_changes_no_resource_version(kube, namespace, operator, wait_for):
    name = f"idem-{uuid.uuid4().hex[:4]}"
    kube.apply(kvcache(name, namespace))
    current = wait_ready(kube, namespace, name, wait_for)
    before = resource_versions(kube, namespace, name)
    outcome = reconcile(current, kube)  # the operator's pass, run once more from here
    assert resource_versions(kube, namespace, name) == before
    assert [e.reason for e in outcome.events] == []
    assert condition({"status": outcome.status}, "Ready")["status"] == "True"


def test_reconcile_records_events_on_the_kvcache(kube, namespace, operator, wait_for):
    name = f"events-{uuid.uuid4().hex[:4]}"
    kube.apply(kvcache(name, namespace))
    wait_ready(kube, namespace, name, wait_for)

    def created_events() -> list[dict]:
        return [
            e
            for e in kube.list("v1", "Event", namespace)
            if e["involvedObject"].get("kind") == S.KIND
            and e["involvedObject"].get("name") == name
            and e.get("reason") == "Created"
        ]

    events = wait_for(created_events, 60, f"Created events on KVCache {name}")
    messages = {e["message"] for e in events}
    assert f"created ConfigMap {S.configmap_name(name)}" in messages


def test_a_spec_change_rolls_an_annotated_deployment_to_a_new_pod_template(
    kube, namespace, operator, wait_for, controllers
):
    name = f"roll-{uuid.uuid4().hex[:4]}"
    kube.apply(kvcache(name, namespace))
    wait_ready(kube, namespace, name, wait_for)
    workload = f"vllm-{name}"
    kube.apply(deployment(workload, namespace, name))

    def template_hashes() -> set[str]:
        sets = kube.list("apps/v1", "ReplicaSet", namespace, f"app={workload}")
        return {rs["metadata"]["labels"]["pod-template-hash"] for rs in sets}

    initial = wait_for(template_hashes, 60, "the Deployment's first ReplicaSet")
    # The spec changes only once the first pod exists: a pod the ReplicaSet
    # creates after the change is injected with the new config already, and
    # then the operator rightly finds nothing to roll.
    first_pods = wait_for(
        lambda: kube.list("v1", "Pod", namespace, f"app={workload}"),
        60,
        "the Deployment's first pod",
    )
    first_hashes = {
        (p["metadata"].get("annotations") or {}).get(S.INJECTED_ANNOTATION) for p in first_pods
    }
    kube.apply(kvcache(name, namespace, l1={"size": "96Mi"}))
    digest = wait_ready(kube, namespace, name, wait_for, generation=2)["status"]["configHash"]
    assert digest not in first_hashes  # injected (where the webhook runs) with generation 1

    def rolled() -> bool:
        found = kube.get("apps/v1", "Deployment", namespace, workload)
        annotations = found["spec"]["template"]["metadata"].get("annotations") or {}
        return annotations.get(S.CONFIG_HASH_ANNOTATION) == digest

    wait_for(rolled, 60, "the config hash on the Deployment's pod template")
    # The Deployment controller (kube-controller-manager) makes a ReplicaSet per template.
    wait_for(lambda: template_hashes() - initial, 60, "a ReplicaSet for the new pod template")


def test_deleting_a_kvcache_garbage_collects_what_it_owned(
    kube, namespace, operator, wait_for, controllers
):
    name = f"shared-{uuid.uuid4().hex[:4]}"
    kube.apply(kvcache(name, namespace, shared={"backend": "valkey", "valkey": {"managed": {}}}))
    sts = wait_for(
        lambda: kube.get("apps/v1", "StatefulSet", namespace, S.valkey_name(name)),
        READY_TIMEOUT_S,
        "the managed Valkey StatefulSet",
    )
    assert sts["metadata"]["ownerReferences"][0]["name"] == name
    owned = [
        ("v1", "ConfigMap", S.configmap_name(name)),
        ("v1", "Secret", S.valkey_auth_secret_name(name)),
        ("apps/v1", "StatefulSet", S.valkey_name(name)),
        ("v1", "Service", S.metrics_service_name(name)),
    ]
    for api_version, kind, obj_name in owned:
        assert kube.get(api_version, kind, namespace, obj_name) is not None, kind
    kube.delete(S.API_VERSION, S.KIND, namespace, name)
    wait_for(
        lambda: all(kube.get(a, k, namespace, n) is None for a, k, n in owned),
        120,
        "the garbage collector to delete the KVCache's ConfigMap, Secret, StatefulSet, Service",
    )


# -- the admission webhook ---------------------------------------------------------


def test_an_annotated_pod_gets_the_sidecar_and_an_unannotated_pod_is_untouched(
    kube, namespace, operator, webhook, wait_for, native_sidecars
):
    if webhook is None:
        pytest.skip(
            "the API server is not on loopback and KVSTRATA_K8S_WEBHOOK_HOST is not set: "
            "it cannot reach the webhook on this machine"
        )
    name = f"inj-{uuid.uuid4().hex[:4]}"
    kube.apply(kvcache(name, namespace))
    wait_ready(kube, namespace, name, wait_for)
    wait_for(
        lambda: _webhook_answers(kube, namespace),
        60,
        f"the API server to call the webhook at {webhook['url']} (a kind cluster's API server "
        "runs in a container: set KVSTRATA_K8S_WEBHOOK_HOST to this machine's address there)",
    )
    kube.apply(pod(f"{name}-a", namespace, {S.CACHE_ANNOTATION: name}))
    injected = kube.get("v1", "Pod", namespace, f"{name}-a")
    if not native_sidecars:  # below the floor: created as is, with the reason
        reason = injected["metadata"]["annotations"][S.SKIPPED_ANNOTATION]
        assert "1.29 or later" in reason
        assert not injected["spec"].get("initContainers")
        return
    inits = {c["name"]: c for c in injected["spec"].get("initContainers") or []}
    assert inits["kvstrata-sidecar"]["restartPolicy"] == "Always"
    assert "--kv-transfer-config" in injected["spec"]["containers"][0]["args"]
    assert injected["metadata"]["labels"][S.CACHE_LABEL] == name
    kube.apply(pod(f"{name}-b", namespace, {}))
    plain = kube.get("v1", "Pod", namespace, f"{name}-b")
    assert not plain["spec"].get("initContainers")
    assert S.SKIPPED_ANNOTATION not in (plain["metadata"].get("annotations") or {})
    kube.apply(pod(f"{name}-c", namespace, {S.CACHE_ANNOTATION: "no-such-cache"}))
    skipped = kube.get("v1", "Pod", namespace, f"{name}-c")
    assert "not found" in skipped["metadata"]["annotations"][S.SKIPPED_ANNOTATION]

    def skip_events() -> list[dict]:
        return [
            e
            for e in kube.list("v1", "Event", namespace)
            if e.get("reason") == "InjectionSkipped"
            and e["involvedObject"].get("name") == f"{name}-c"
        ]

    events = wait_for(skip_events, 60, f"the InjectionSkipped Event of pod {name}-c")
    assert "KVCache" in events[0]["message"] and "not found" in events[0]["message"]


def test_a_pod_is_still_created_when_the_webhook_is_down(kube, namespace):
    # The chart's failurePolicy and timeout, pointed at a port where nothing listens,
    # and only for pods carrying this test's label.
    label = f"down-{uuid.uuid4().hex[:4]}"
    name = f"{namespace}-{label}"
    dead_url = f"https://127.0.0.1:{free_port()}/inject"
    ca = certs.issue(["127.0.0.1"]).ca_crt
    selector = {"matchLabels": {"kvstrata-test/webhook": label}}
    kube.apply(webhook_configuration(name, dead_url, ca, namespace, object_selector=selector))
    try:
        kube.apply(
            pod(label, namespace, {S.CACHE_ANNOTATION: "any"}, **{"kvstrata-test/webhook": label})
        )
        created = kube.get("v1", "Pod", namespace, label)
        assert created is not None
        assert not created["spec"].get("initContainers")
    finally:
        kube.delete(ADMISSION, "MutatingWebhookConfiguration", "", name)


RESTRICTED_LABEL = {"pod-security.kubernetes.io/enforce": "restricted"}


def restricted_pod(name: str, namespace: str, annotations: dict[str, str]) -> dict:
    """A pod whose own container complies with the restricted Pod Security Standard."""
    made = pod(name, namespace, annotations)
    made["spec"]["containers"][0]["securityContext"] = {
        "runAsNonRoot": True,
        "runAsUser": 1000,
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    return made


def test_an_injected_pod_is_admitted_where_the_namespace_enforces_restricted(
    kube, operator, webhook, wait_for, native_sidecars
):
    if webhook is None or not native_sidecars:
        pytest.skip("needs the webhook reachable and native sidecars (Kubernetes 1.29 or later)")
    restricted = f"kvstrata-restricted-{uuid.uuid4().hex[:6]}"
    kube.apply(
        {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {"name": restricted, "labels": RESTRICTED_LABEL},
        }
    )
    config = f"{restricted}-inject"
    kube.apply(webhook_configuration(config, webhook["url"], webhook["ca"], restricted))
    try:
        name = f"psa-{uuid.uuid4().hex[:4]}"
        kube.apply(kvcache(name, restricted))  # read by the webhook; not reconciled here
        wait_for(
            until_account(lambda: _webhook_answers(kube, restricted, restricted_pod)),
            60,
            f"the API server to call the webhook for pods of {restricted}",
        )
        # The API server's PodSecurity admission runs after the mutating webhooks:
        # it judges the pod with the sidecar and the installer in it.
        kube.apply(restricted_pod(f"{name}-a", restricted, {S.CACHE_ANNOTATION: name}))
        admitted = kube.get("v1", "Pod", restricted, f"{name}-a")
        inits = {c["name"] for c in admitted["spec"]["initContainers"]}
        assert {"kvstrata-sidecar", "kvstrata-install"} <= inits
        # The namespace does enforce: a container without a seccomp profile is refused.
        loose = restricted_pod(f"{name}-b", restricted, {S.CACHE_ANNOTATION: name})
        del loose["spec"]["containers"][0]["securityContext"]["seccompProfile"]
        with pytest.raises(ApiException) as refused:
            kube.apply(loose)
        assert refused.value.status == 403 and "seccompProfile" in str(refused.value)
        assert "kvstrata-" not in str(refused.value).split("violates PodSecurity")[-1]
    finally:
        kube.delete(ADMISSION, "MutatingWebhookConfiguration", "", config)
        kube.delete("v1", "Namespace", "", restricted)


def until_account(step):
    """``step`` as a poll condition: "not yet" while the API server refuses pods for want of
    their namespace's default service account (made by the controller manager just after
    the namespace)."""

    def attempt():
        try:
            return step()
        except ApiException as exc:
            if exc.status == 403 and "serviceaccount" in str(exc).lower():
                return None
            raise

    return attempt


def chart_namespace_selector() -> dict[str, Any]:
    """The webhook's namespaceSelector as the chart renders it by default."""
    import helm_python as helm
    import yaml

    manifests = helm.Chart.load(REPO / "charts" / "kvstrata").render(
        values={}, name="kvstrata", namespace="kvstrata-system"
    )
    for path, text in manifests.items():
        if not path.endswith(".yaml"):
            continue  # NOTES.txt
        for doc in yaml.safe_load_all(text):
            if doc and doc["kind"] == "MutatingWebhookConfiguration":
                return doc["webhooks"][0]["namespaceSelector"]
    raise AssertionError("the chart renders no MutatingWebhookConfiguration")


def test_the_api_server_sends_the_webhook_only_pods_of_namespaces_that_opt_in(
    kube, operator, webhook, wait_for
):
    if webhook is None:
        pytest.skip("needs the webhook reachable from the API server")
    suffix = uuid.uuid4().hex[:6]
    opted_in, other = f"kvstrata-optin-{suffix}", f"kvstrata-other-{suffix}"
    label = {"kvstrata.io/injection": "enabled"}
    for name, labels in ((opted_in, label), (other, {})):
        kube.apply(
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels}}
        )
    config = webhook_configuration(f"optin-{suffix}", webhook["url"], webhook["ca"], opted_in)
    config["webhooks"][0]["namespaceSelector"] = chart_namespace_selector()
    kube.apply(config)
    try:
        # The webhook answers for the labelled namespace (it marks a pod naming no cache) ...
        wait_for(
            until_account(lambda: _webhook_answers(kube, opted_in)),
            60,
            f"the API server to call the webhook for pods of {opted_in}",
        )
        # ... and is never asked about the same pod in a namespace without the label.
        unsent = pod("unsent", other, {S.CACHE_ANNOTATION: "probe-absent"})
        created = wait_for(
            until_account(lambda: kube.apply(unsent)), 60, f"a pod created in {other}"
        )
        assert created is not None
        assert S.SKIPPED_ANNOTATION not in (created["metadata"].get("annotations") or {})
    finally:
        kube.delete(ADMISSION, "MutatingWebhookConfiguration", "", config["metadata"]["name"])
        for name in (opted_in, other):
            kube.delete("v1", "Namespace", "", name)


def _webhook_answers(kube, namespace: str, make=None) -> bool:
    """Create a probe pod that asks for a missing cache; the webhook marks it when up."""
    probe = f"probe-{uuid.uuid4().hex[:6]}"
    kube.apply((make or pod)(probe, namespace, {S.CACHE_ANNOTATION: "probe-absent"}))
    created = kube.get("v1", "Pod", namespace, probe) or {}
    kube.delete("v1", "Pod", namespace, probe)
    return S.SKIPPED_ANNOTATION in ((created.get("metadata") or {}).get("annotations") or {})


def test_encryption_on_gets_a_keys_secret_that_a_second_pass_leaves_alone(
    kube, namespace, operator, wait_for
):
    name = f"enc-{uuid.uuid4().hex[:4]}"
    kube.apply(kvcache(name, namespace, encryption={"mode": "required", "rotateEvery": "720h"}))
    current = wait_ready(kube, namespace, name, wait_for)
    secret = kube.get("v1", "Secret", namespace, E.keys_secret_name(name))
    assert secret is not None
    assert secret["metadata"]["ownerReferences"][0]["uid"] == current["metadata"]["uid"]
    files = {k: base64.b64decode(v) for k, v in secret["data"].items()}
    writing = json.loads(files[E.INDEX_FILE])["writing"]
    assert len(files[f"{writing}.key"]) == 32
    cm = kube.get("v1", "ConfigMap", namespace, S.configmap_name(name))
    assert S.ENCRYPTION_KEY_DIR in cm["data"]["sidecar.yaml"]
    before = secret["metadata"]["resourceVersion"]
    reconcile(current, kube)  # within the rotation period: nothing to change
    again = kube.get("v1", "Secret", namespace, E.keys_secret_name(name))
    assert again["metadata"]["resourceVersion"] == before
