"""Reconcile passes: conditions, convergence, shared tiers on real servers, rolling, handlers."""

from __future__ import annotations

import base64
import types

import boto3
import kopf
import pytest

from kvstrata.operator import handlers, rollout
from kvstrata.operator import reconcile as rec
from kvstrata.operator import spec as S
from kvstrata.testing.servers import MotoS3Server, RedisServer, ServerError, redis_server_binary

from .events import record_events

MANAGED = {"backend": "valkey", "valkey": {"managed": {"replicas": 2}}}
NOW = "2026-01-01T00:00:00Z"
LATER = "2026-01-01T00:05:00Z"


def cond(status, ctype):
    return next(c for c in status["conditions"] if c["type"] == ctype)


def secret(name, **data):
    encoded = {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "namespace": "ml"},
        "data": encoded,
    }


@pytest.fixture(scope="module")
def moto_s3():
    with MotoS3Server() as server:
        yield server


@pytest.fixture(scope="module")
def redis_with_password(tmp_path_factory):
    try:
        redis_server_binary()
    except ServerError as exc:
        pytest.fail(f"{exc}; run `make system-deps`")
    with RedisServer(tmp_path_factory.mktemp("valkey"), password="s3cret") as server:
        yield server


def test_a_cache_without_shared_tier_is_ready_with_its_configmap(make_kvcache, cluster):
    out = rec.reconcile(make_kvcache(l1={"size": "2Gi"}), cluster, now=NOW)
    assert out.retry_after is None and out.permanent is None
    assert cond(out.status, "Ready")["status"] == "True"
    assert cond(out.status, "Degraded")["status"] == "False"
    assert cond(out.status, "SharedTierReady")["reason"] == "NoSharedTier"
    assert out.status["observedGeneration"] == 1
    assert out.status["sharedTier"] == "none"
    cm = cluster.get("v1", "ConfigMap", "ml", "demo-sidecar")
    assert f"size_bytes: {2 << 30}" in cm["data"]["sidecar.yaml"]
    assert [e.message for e in out.events] == [
        "created ConfigMap demo-sidecar",
        "created Service demo-metrics",
    ]


def test_reconciling_again_changes_nothing_and_keeps_transition_times(make_kvcache, cluster):
    kvcache = make_kvcache(shared=MANAGED)
    first = rec.reconcile(kvcache, cluster, now=NOW)
    versions = {k: o["metadata"]["resourceVersion"] for k, o in cluster.objects.items()}
    kvcache["status"] = first.status
    second = rec.reconcile(kvcache, cluster, now=LATER)
    assert {k: o["metadata"]["resourceVersion"] for k, o in cluster.objects.items()} == versions
    assert second.events == []
    assert second.status == first.status
    assert cond(second.status, "Ready")["lastTransitionTime"] == NOW


def test_a_managed_valkey_converges_then_the_cache_becomes_ready(make_kvcache, cluster):
    kvcache = make_kvcache(shared=MANAGED)
    out = rec.reconcile(kvcache, cluster, now=NOW)
    assert out.retry_after == rec.CONVERGE_DELAY_S
    assert cond(out.status, "Ready")["status"] == "False"
    assert cond(out.status, "SharedTierReady")["reason"] == "ValkeyStarting"
    assert cond(out.status, "Degraded")["status"] == "False"  # starting is not degraded
    kinds = sorted(k for (_, k, _, _) in cluster.objects)
    assert kinds == ["ConfigMap", "Secret", "Service", "Service", "Service", "StatefulSet"]
    assert out.status["endpoints"]["valkey"] == "redis://demo-valkey.ml.svc:6379/0"
    cluster.objects[("apps/v1", "StatefulSet", "ml", "demo-valkey")]["status"] = {
        "readyReplicas": 2
    }
    kvcache["status"] = out.status
    ready = rec.reconcile(kvcache, cluster, now=LATER)
    assert ready.retry_after is None
    assert cond(ready.status, "Ready")["status"] == "True"
    assert cond(ready.status, "Ready")["lastTransitionTime"] == LATER
    assert cond(ready.status, "Degraded")["status"] == "False"


def test_a_spec_the_loader_refuses_is_a_permanent_error_naming_the_field(make_kvcache, cluster):
    out = rec.reconcile(make_kvcache(l1={"size": "100Ki"}), cluster, now=NOW)
    assert out.permanent and "l1.size_bytes" in out.permanent
    ready = cond(out.status, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "InvalidSpec")
    assert "l1.size_bytes" in ready["message"]
    assert cluster.objects == {}


def test_an_external_valkey_is_pinged_with_the_password_from_its_secret(
    make_kvcache, cluster, redis_with_password
):
    external = {"url": redis_with_password.url, "passwordSecretRef": {"name": "pw"}}
    kvcache = make_kvcache(shared={"backend": "valkey", "valkey": {"external": external}})
    cluster.put(secret("pw", password="wrong"))
    out = rec.reconcile(kvcache, cluster, now=NOW)
    assert cond(out.status, "SharedTierReady")["reason"] == "ValkeyUnreachable"
    assert out.retry_after == rec.UNREACHABLE_DELAY_S
    assert cond(out.status, "Degraded")["status"] == "True"
    assert [e.type for e in out.events if e.reason == "ValkeyUnreachable"] == ["Warning"]
    cluster.put(secret("pw", password="s3cret"))
    kvcache["status"] = out.status
    ok = rec.reconcile(kvcache, cluster, now=LATER)
    assert cond(ok.status, "Ready")["status"] == "True"
    assert cond(ok.status, "SharedTierReady")["reason"] == "ValkeyReachable"


def test_s3_bucket_is_created_when_asked_and_the_prefix_marked(make_kvcache, cluster, moto_s3):
    cluster.put(secret("creds", **{"access-key-id": "AK", "secret-access-key": "SK"}))
    s3 = {
        "endpoint": moto_s3.endpoint_url,
        "bucket": "created-by-operator",
        "prefix": "llama/",
        "credentialsSecretRef": {"name": "creds"},
    }
    missing = rec.reconcile(make_kvcache(shared={"backend": "s3", "s3": s3}), cluster, now=NOW)
    assert cond(missing.status, "SharedTierReady")["reason"] == "BucketMissing"
    out = rec.reconcile(
        make_kvcache(shared={"backend": "s3", "s3": {**s3, "createBucket": True}}), cluster, now=NOW
    )
    assert cond(out.status, "SharedTierReady")["reason"] == "BucketCreated"
    assert cond(out.status, "Ready")["status"] == "True"
    client = boto3.client(
        "s3",
        endpoint_url=moto_s3.endpoint_url,
        region_name="us-east-1",
        aws_access_key_id="AK",
        aws_secret_access_key="SK",
    )
    marker = client.get_object(Bucket="created-by-operator", Key="llama/.kvstrata")
    assert marker["Body"].read() == b'{"kvcache": "ml/demo"}'
    again = rec.reconcile(
        make_kvcache(shared={"backend": "s3", "s3": {**s3, "createBucket": True}}), cluster, now=NOW
    )
    assert cond(again.status, "SharedTierReady")["reason"] == "BucketReady"


def workload(kind, name, annotations):
    return {
        "apiVersion": "apps/v1",
        "kind": kind,
        "metadata": {"name": name, "namespace": "ml"},
        "spec": {
            "selector": {"matchLabels": {"app": name}},
            "template": {"metadata": {"annotations": annotations}, "spec": {}},
        },
    }


def test_a_spec_change_rolls_only_the_workloads_that_use_the_cache(make_kvcache, cluster):
    cluster.put(workload("Deployment", "llama", {S.CACHE_ANNOTATION: "demo"}))
    cluster.put(workload("StatefulSet", "qwen", {S.CACHE_ANNOTATION: "demo"}))
    cluster.put(workload("Deployment", "unrelated", {S.CACHE_ANNOTATION: "other"}))
    first = rec.reconcile(make_kvcache(), cluster, now=NOW)
    rolled = sorted(e.message.split(":")[0] for e in first.events if e.reason == "RolledWorkload")
    assert rolled == ["Deployment llama", "StatefulSet qwen"]  # pods made before the cache
    assert {n for _, n, _ in cluster.patches} == {"llama", "qwen"}
    cluster.patches.clear()
    same = rec.reconcile(make_kvcache(), cluster, now=NOW)
    assert cluster.patches == [] and same.events == []
    changed = rec.reconcile(make_kvcache(l1={"size": "4Gi"}), cluster, now=NOW)
    assert sorted(
        e.message.split(":")[0] for e in changed.events if e.reason == "RolledWorkload"
    ) == [
        "Deployment llama",
        "StatefulSet qwen",
    ]
    llama = cluster.get("apps/v1", "Deployment", "ml", "llama")
    stamp = llama["spec"]["template"]["metadata"]["annotations"][S.CONFIG_HASH_ANNOTATION]
    assert stamp == changed.status["configHash"]
    other = cluster.get("apps/v1", "Deployment", "ml", "unrelated")
    assert S.CONFIG_HASH_ANNOTATION not in other["spec"]["template"]["metadata"]["annotations"]


def test_a_workload_whose_pods_already_run_the_current_config_is_not_rolled(
    make_kvcache, make_pod, cluster
):
    cluster.put(workload("Deployment", "fresh", {S.CACHE_ANNOTATION: "demo"}))
    digest = rec.desired_objects(make_kvcache(), cluster)[1]
    for i, injected in enumerate([digest, digest]):
        pod = make_pod()
        pod["metadata"].update(name=f"fresh-{i}", labels={"app": "fresh"})
        pod["metadata"]["annotations"][S.INJECTED_ANNOTATION] = injected
        cluster.put(pod)
    out = rec.reconcile(make_kvcache(), cluster, now=NOW)
    assert cluster.patches == [] and "RolledWorkload" not in [e.reason for e in out.events]
    stale = make_pod()
    stale["metadata"].update(name="fresh-old", labels={"app": "fresh"})  # made before the cache
    cluster.put(stale)
    out = rec.reconcile(make_kvcache(), cluster, now=NOW)
    assert [n for _, n, _ in cluster.patches] == ["fresh"]


def test_injected_pods_are_counted_in_status(make_kvcache, make_pod, cluster):
    for i in range(3):
        pod = make_pod()
        pod["metadata"].update(name=f"p{i}", labels={S.CACHE_LABEL: "demo" if i else "x"})
        cluster.put(pod)
    assert rec.reconcile(make_kvcache(), cluster, now=NOW).status["injectedPods"] == 2


def test_the_servicemonitor_is_created_only_when_its_crd_exists(make_kvcache, cluster):
    kvcache = make_kvcache(metrics={"serviceMonitor": {"enabled": True}})
    out = rec.reconcile(kvcache, cluster, now=NOW)
    assert "ServiceMonitorSkipped" in [e.reason for e in out.events]
    assert not any(k == "ServiceMonitor" for (_, k, _, _) in cluster.objects)
    assert cluster.get("v1", "Service", "ml", "demo-metrics") is not None
    cluster.kinds.add(rec.SERVICEMONITOR_API)
    rec.reconcile(kvcache, cluster, now=NOW)
    assert cluster.get(*rec.SERVICEMONITOR_API, "ml", "demo") is not None


def _handler_kwargs(kvcache, cluster, events):
    body = kopf.Body(kvcache)
    memo = types.SimpleNamespace(cluster=cluster)
    record_events(events)
    return {"body": body, "patch": kopf.Patch(body=body), "memo": memo, "logger": handlers.logger}


def test_the_handler_patches_status_and_posts_events(make_kvcache, cluster):
    events = []
    kwargs = _handler_kwargs(make_kvcache(), cluster, events)
    handlers.reconcile_kvcache(**kwargs)
    assert kwargs["patch"]["status"]["conditions"][0]["type"] in {"Ready", "SharedTierReady"}
    assert cond(kwargs["patch"]["status"], "Ready")["status"] == "True"
    assert events[0]["reason"] == "Created"


def test_the_handler_retries_while_valkey_starts_and_gives_up_on_a_bad_spec(make_kvcache, cluster):
    events = []
    kwargs = _handler_kwargs(make_kvcache(shared=MANAGED), cluster, events)
    with pytest.raises(kopf.TemporaryError) as temporary:
        handlers.reconcile_kvcache(**kwargs)
    assert temporary.value.delay == rec.CONVERGE_DELAY_S
    assert cond(kwargs["patch"]["status"], "Ready")["reason"] == "ValkeyStarting"
    kwargs = _handler_kwargs(make_kvcache(l1={"policy": "mru"}), cluster, events)
    with pytest.raises(kopf.PermanentError, match=r"l1\.policy"):
        handlers.reconcile_kvcache(**kwargs)
    assert cond(kwargs["patch"]["status"], "Ready")["reason"] == "InvalidSpec"
    kwargs = _handler_kwargs(make_kvcache(l1={"policy": "mru"}), cluster, events)
    handlers.recheck_kvcache(**kwargs)  # the timer does not raise again for a bad spec


def opt_in_webhook(name="kvstrata-webhook"):
    """The webhook configuration as the chart renders it by default (the opt-in label)."""
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": name},
        "webhooks": [
            {
                "name": "inject.kvstrata.io",
                "namespaceSelector": {
                    "matchLabels": {"kvstrata.io/injection": "enabled"},
                    "matchExpressions": [
                        {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": []}
                    ],
                },
            }
        ],
    }


def namespace(name, labels):
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels}}


def test_a_workload_in_a_namespace_without_the_opt_in_label_is_not_rolled_and_says_why(
    make_kvcache, cluster
):
    cluster.put(opt_in_webhook())
    cluster.put(namespace("ml", {"kubernetes.io/metadata.name": "ml"}))
    cluster.put(workload("Deployment", "llama", {S.CACHE_ANNOTATION: "demo"}))
    outcome = rec.reconcile(make_kvcache(), cluster, now=NOW, webhook_config="kvstrata-webhook")
    # Not stamped: rolled pods would come back without a sidecar.
    llama = cluster.get("apps/v1", "Deployment", "ml", "llama")
    assert S.CONFIG_HASH_ANNOTATION not in llama["spec"]["template"]["metadata"]["annotations"]
    assert not [p for p in cluster.patches if p[0] == "Deployment"]
    assert outcome.status["notRolled"] == ["Deployment/llama"]
    (warning,) = [e for e in outcome.events if e.reason == "NamespaceNotOptedIn"]
    assert warning.type == "Warning" and "kvstrata.io/injection=enabled" in warning.message
    # The Deployment's owner sees it on the Deployment too.
    (event,) = [o for k, o in cluster.objects.items() if k[1] == "Event"]
    assert event["involvedObject"]["name"] == "llama"
    assert event["involvedObject"]["kind"] == "Deployment"
    assert "kvstrata.io/injection=enabled" in event["message"]
    # A second pass updates the one Event rather than adding another.
    rec.reconcile(make_kvcache(), cluster, now=NOW, webhook_config="kvstrata-webhook")
    assert len([k for k in cluster.objects if k[1] == "Event"]) == 1
    # Once the namespace opts in, the next pass rolls it.
    cluster.put(namespace("ml", {"kvstrata.io/injection": "enabled"}))
    opted = rec.reconcile(make_kvcache(), cluster, now=NOW, webhook_config="kvstrata-webhook")
    assert [e.message.split(":")[0] for e in opted.events if e.reason == "RolledWorkload"] == [
        "Deployment llama"
    ]
    assert opted.status["notRolled"] == []


def test_an_unreadable_webhook_configuration_does_not_stop_rolling(make_kvcache, cluster):
    cluster.put(workload("Deployment", "llama", {S.CACHE_ANNOTATION: "demo"}))
    # No configuration stored (cert-manager installs, no permission): unknown, so rolled.
    outcome = rec.reconcile(make_kvcache(), cluster, now=NOW, webhook_config="kvstrata-webhook")
    assert [e.reason for e in outcome.events].count("RolledWorkload") == 1
    assert outcome.status["notRolled"] == []


def pod_from(template_annotations, name, **extra):
    """A pod as the ReplicaSet makes it: the template's annotations copied, plus ``extra``
    (what the webhook adds when the API server calls it)."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": "ml",
            "labels": {"app": "later"},
            "annotations": {**template_annotations, **extra},
        },
        "spec": {"containers": [{"name": "main", "image": "busybox"}]},
    }


def remove_pod(cluster, name):
    """The pod gone, as the ReplicaSet controller deletes it in a rollout."""
    del cluster.objects[("v1", "Pod", "ml", name)]


def template_of(cluster, name="later"):
    found = cluster.get("apps/v1", "Deployment", "ml", name)
    return found["spec"]["template"]["metadata"]["annotations"]


def test_pods_admitted_without_the_webhook_are_rolled_again_though_the_template_is_current(
    make_kvcache, cluster
):
    # Seen on a real node: the operator, back after a downtime, stamped the current hash
    # on a Deployment; its new pod was admitted before the webhook's Service had the
    # operator's pod as an endpoint (failurePolicy Ignore), so it ran without a sidecar
    # and, the template being current, was never rolled again.
    digest = rec.desired_objects(make_kvcache(), cluster)[1]
    stamped = {S.CACHE_ANNOTATION: "demo", S.CONFIG_HASH_ANNOTATION: digest}
    cluster.put(workload("Deployment", "later", stamped))
    cluster.put(pod_from(stamped, "later-1"))  # no sidecar, no skip reason: never seen
    out = rec.reconcile(make_kvcache(), cluster, now=NOW)
    assert [n for _, n, _ in cluster.patches] == ["later"]
    assert template_of(cluster)[S.REROLL_ANNOTATION] == "1"
    assert template_of(cluster)[S.CONFIG_HASH_ANNOTATION] == digest
    (event,) = [e for e in out.events if e.reason == "RolledWorkload"]
    assert "re-roll 1" in event.message

    # The controller replaces the pod; the webhook injects the new one: nothing more to do.
    cluster.patches.clear()
    remove_pod(cluster, "later-1")
    cluster.put(pod_from(template_of(cluster), "later-2", **{S.INJECTED_ANNOTATION: digest}))
    rec.reconcile(make_kvcache(), cluster, now=NOW)
    assert cluster.patches == []


def test_the_old_templates_pods_during_a_rollout_and_skipped_pods_cause_no_reroll(
    make_kvcache, cluster
):
    digest = rec.desired_objects(make_kvcache(), cluster)[1]
    old = {S.CACHE_ANNOTATION: "demo", S.CONFIG_HASH_ANNOTATION: digest}
    current = {**old, S.REROLL_ANNOTATION: "1"}
    cluster.put(workload("Deployment", "later", current))
    cluster.put(pod_from(old, "later-old"))  # the previous template's: being replaced
    cluster.put(pod_from(current, "later-new", **{S.SKIPPED_ANNOTATION: "no_such_cache"}))
    rec.reconcile(make_kvcache(), cluster, now=NOW)
    assert cluster.patches == []


def test_rerolls_stop_after_a_few_when_the_webhook_is_never_reached(make_kvcache, cluster):
    digest = rec.desired_objects(make_kvcache(), cluster)[1]
    stamped = {S.CACHE_ANNOTATION: "demo", S.CONFIG_HASH_ANNOTATION: digest}
    cluster.put(workload("Deployment", "later", stamped))
    for attempt in range(1, rollout.MAX_REROLLS + 2):
        for found in cluster.list("v1", "Pod", "ml"):
            remove_pod(cluster, found["metadata"]["name"])
        cluster.put(pod_from(template_of(cluster), f"later-{attempt}"))  # unseen again
        cluster.patches.clear()
        rec.reconcile(make_kvcache(), cluster, now=NOW)
        if attempt <= rollout.MAX_REROLLS:
            assert template_of(cluster)[S.REROLL_ANNOTATION] == str(attempt)
        else:
            assert cluster.patches == []  # given up: the workload is left as it is


def test_a_config_change_drops_the_reroll_count(make_kvcache, cluster):
    digest = rec.desired_objects(make_kvcache(), cluster)[1]
    rerolled = {S.CACHE_ANNOTATION: "demo", S.CONFIG_HASH_ANNOTATION: digest}
    cluster.put(workload("Deployment", "later", {**rerolled, S.REROLL_ANNOTATION: "3"}))
    changed = rec.reconcile(make_kvcache(l1={"size": "4Gi"}), cluster, now=NOW)
    assert template_of(cluster)[S.CONFIG_HASH_ANNOTATION] == changed.status["configHash"]
    assert S.REROLL_ANNOTATION not in template_of(cluster)
