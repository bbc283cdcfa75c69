"""The Helm chart rendered by Helm's own engine: images, least-privilege RBAC.

``helm-python-sdk`` (PyPI) carries Helm's Go library and renders the chart
offline exactly as ``helm template`` does (values schema included), so these
tests read the manifests a ``helm install`` would send.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml

from kvstrata import __version__
from kvstrata.operator import spec as S
from kvstrata.testing.apirules import selector_matches
from kvstrata.testing.podsecurity import restricted_violations

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "kvstrata"
RELEASE, RELEASE_NS = "kvs", "kvstrata-system"
DIGEST = "sha256:" + "ab" * 32
# Namespaced kinds the operator uses: never granted cluster-wide while it watches some namespaces.
# API groups of kinds not in the Kubernetes schemas (cert-manager, the Prometheus
# Operator, kopf's peering).
THIRD_PARTY = ("cert-manager.io/", "monitoring.coreos.com/", "kopf.dev/")
NAMESPACED = {"secrets", "configmaps", "services", "statefulsets", "deployments", "kvcaches"}


def render(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    manifests = helm.Chart.load(CHART).render(
        values=values or {}, name=RELEASE, namespace=RELEASE_NS
    )
    docs = []
    for name, text in manifests.items():
        if name.endswith(".yaml"):
            docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def rendered_text(values: dict[str, Any] | None = None) -> dict[str, str]:
    return helm.Chart.load(CHART).render(values=values or {}, name=RELEASE, namespace=RELEASE_NS)


def one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    (found,) = [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    return found


def operator_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]


def operator_env(docs: list[dict[str, Any]]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in operator_container(docs)["env"] if "value" in e}


def test_helm_lints_the_chart_without_a_finding():
    report = helm.lint(CHART, strict=True, namespace=RELEASE_NS)
    assert report["errors"] == [], report
    assert [m for m in report["messages"] if m["severity"] >= 2] == [], report


@pytest.mark.parametrize(
    "values",
    [
        {},
        {"operator": {"watchNamespaces": ["ml", "team-b"]}},
        {"webhook": {"certManager": {"enabled": True}}},
        {"monitoring": {"serviceMonitor": {"enabled": True}, "dashboard": {"enabled": True}}},
    ],
    ids=["defaults", "watching-two-namespaces", "cert-manager", "monitoring"],
)
def test_every_rendered_object_is_valid_kubernetes(values, k8s_valid):
    for doc in render(values):
        if doc["apiVersion"].startswith(THIRD_PARTY):
            continue  # third-party kinds: not in the Kubernetes schemas
        k8s_valid(doc)


def test_the_chart_version_the_package_version_and_the_image_tags_agree():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["appVersion"] == __version__
    assert f'version = "{__version__}"' in (REPO / "pyproject.toml").read_text()


def test_the_default_images_are_the_ones_make_images_builds():
    built = subprocess.run(
        ["make", "--no-print-directory", "-s", "-C", str(REPO), "image-names"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    by_target = {re.sub(r"^.*/kvstrata-(.*):.*$", r"\1", ref): ref for ref in built}
    assert set(by_target) == {"operator", "sidecar", "sidecar-cuda"}
    dockerfile = (REPO / "Dockerfile").read_text()
    for target in by_target:
        assert re.search(rf"^FROM \S+ AS {target}$", dockerfile, re.M), target

    docs = render()
    assert operator_container(docs)["image"] == by_target["operator"]
    env = operator_env(docs)
    assert env["KVSTRATA_OPERATOR_SIDECAR_IMAGE"] == by_target["sidecar"]
    assert env["KVSTRATA_OPERATOR_SIDECAR_CUDA_IMAGE"] == by_target["sidecar-cuda"]
    assert env["KVSTRATA_OPERATOR_INSTALLER_IMAGE"] == by_target["sidecar"]
    # The operator's own defaults (no chart around it) are the same images.
    defaults = S.Images()
    assert (defaults.sidecar.ref, defaults.sidecar_cuda.ref, defaults.installer.ref) == (
        by_target["sidecar"],
        by_target["sidecar-cuda"],
        by_target["sidecar"],
    )
    assert env["KVSTRATA_OPERATOR_VALKEY_IMAGE"] == defaults.valkey.ref


def test_every_image_value_reaches_the_operator_with_its_tag_digest_and_pull_policy():
    values = {
        "image": {"repository": "registry.example/ops", "tag": "7", "digest": DIGEST},
        "sidecar": {
            "image": {"repository": "registry.example/sc", "pullPolicy": "Always"},
            "cudaImage": {"repository": "registry.example/sc-cuda", "tag": "7-cuda"},
        },
        "installer": {"image": {"repository": "registry.example/inst", "digest": DIGEST}},
        "valkey": {"image": {"repository": "registry.example/valkey", "tag": "8.1.0"}},
    }
    docs = render(values)
    assert operator_container(docs)["image"] == f"registry.example/ops:7@{DIGEST}"
    env = operator_env(docs)
    images = S.Images.from_env(env)
    assert images.sidecar == S.Image(f"registry.example/sc:{__version__}", "Always")
    assert images.sidecar_cuda == S.Image("registry.example/sc-cuda:7-cuda", "IfNotPresent")
    assert images.installer.ref == f"registry.example/inst:{__version__}@{DIGEST}"
    assert images.valkey.ref == "registry.example/valkey:8.1.0"


@pytest.mark.parametrize(
    "values",
    [
        {"sidecar": {"image": {"digest": "sha256:short"}}},
        {"installer": {"image": {"pullPolicy": "Sometimes"}}},
        {"valkey": {"image": {"tag": ""}}},
        {"sidecar": {"cudaImage": {"repository": ""}}},
        {"operator": {"watchNamespaces": ["ml", "ml"]}},
    ],
)
def test_helm_refuses_malformed_image_and_namespace_values(values):
    with pytest.raises(helm.HelmError, match="schema"):
        render(values)


def rbac(docs: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Rules by where they hold: ``*`` (ClusterRole) or the Role's namespace."""
    out: dict[str, list[dict[str, Any]]] = {}
    for doc in docs:
        if doc["kind"] == "ClusterRole":
            out.setdefault("*", []).extend(doc["rules"])
        elif doc["kind"] == "Role":
            out.setdefault(doc["metadata"]["namespace"], []).extend(doc["rules"])
    return out


def granted(rules: list[dict[str, Any]]) -> set[str]:
    return {r for rule in rules for r in rule["resources"]}


@pytest.mark.parametrize(
    "values", [{}, {"operator": {"watchNamespaces": ["ml"]}}], ids=["all", "some"]
)
def test_the_operator_may_read_a_namespace_and_the_webhook_configuration(values):
    # What injection_scope reads before rolling a workload: the namespace's
    # labels and the webhook configuration's namespaceSelector.
    rules = rbac(render(values))["*"]
    verbs = {v for rule in rules if "namespaces" in rule["resources"] for v in rule["verbs"]}
    assert "get" in verbs
    config = [r for r in rules if "mutatingwebhookconfigurations" in r["resources"]]
    assert config and all("get" in r["verbs"] for r in config)


def test_watching_all_namespaces_grants_the_namespaced_rules_cluster_wide_only():
    by_scope = rbac(render())
    assert set(by_scope) == {"*"}
    assert granted(by_scope["*"]) >= NAMESPACED


def test_watching_some_namespaces_grants_secrets_and_workloads_in_those_namespaces_only():
    docs = render({"operator": {"watchNamespaces": ["ml", "team-b"]}})
    by_scope = rbac(docs)
    assert set(by_scope) == {"*", "ml", "team-b", RELEASE_NS}
    assert granted(by_scope["*"]) & (NAMESPACED | {"pods", "events"}) == set()
    assert granted(by_scope["*"]) == {
        "customresourcedefinitions",
        "namespaces",
        "mutatingwebhookconfigurations",
    }
    for namespace in ("ml", "team-b"):
        assert granted(by_scope[namespace]) >= NAMESPACED
        binding = one(
            [d for d in docs if d["metadata"].get("namespace") == namespace], "RoleBinding"
        )
        assert binding["roleRef"]["kind"] == "Role"
        assert binding["subjects"][0]["namespace"] == RELEASE_NS
    # In its own namespace the operator keeps the webhook certificate, by name.
    tls = by_scope[RELEASE_NS]
    assert granted(tls) == {"secrets"}
    named = [r for r in tls if set(r["verbs"]) & {"get", "patch"}]
    assert named and all(r["resourceNames"] == [f"{RELEASE}-kvstrata-webhook-tls"] for r in named)
    assert {v for r in tls if "resourceNames" not in r for v in r["verbs"]} == {"create"}
    # The webhook is sent only the pods of the watched namespaces.
    (webhook,) = one(docs, "MutatingWebhookConfiguration")["webhooks"]
    assert webhook["namespaceSelector"]["matchExpressions"] == [
        {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["ml", "team-b"]}
    ]
    args = operator_container(docs)["args"]
    assert args == ["--watch-namespace=ml", "--watch-namespace=team-b"]


def test_with_cert_manager_the_operator_gets_no_secret_or_webhook_access_of_its_own():
    docs = render(
        {"operator": {"watchNamespaces": ["ml"]}, "webhook": {"certManager": {"enabled": True}}}
    )
    by_scope = rbac(docs)
    assert set(by_scope) == {"*", "ml"}
    assert "mutatingwebhookconfigurations" not in granted(by_scope["*"])


@pytest.mark.parametrize(
    "values", [{}, {"operator": {"watchNamespaces": ["ml"]}}], ids=["all", "some"]
)
def test_every_rendered_rbac_rule_says_why_in_a_comment(values):
    text = rendered_text(values)["kvstrata/templates/rbac.yaml"]
    lines = text.splitlines()
    rules = [i for i, line in enumerate(lines) if line.lstrip().startswith("- apiGroups:")]
    assert rules
    for i in rules:
        assert lines[i - 1].lstrip().startswith("#"), f"rule without a reason:\n{lines[i]}"
    assert "'*'" not in text and '"*"' not in text


def test_the_operator_metrics_port_is_served_by_a_service_its_servicemonitor_selects():
    docs = render(
        {"monitoring": {"serviceMonitor": {"enabled": True}}, "operator": {"metricsPort": 9777}}
    )
    container = operator_container(docs)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["metrics"] == 9777
    assert operator_env(docs)["KVSTRATA_OPERATOR_METRICS_PORT"] == "9777"
    services = [d for d in docs if d["kind"] == "Service"]
    (service,) = [s for s in services if any(p["name"] == "metrics" for p in s["spec"]["ports"])]
    assert service["spec"]["ports"][0]["targetPort"] == "metrics"
    pod_labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    monitors = [d for d in docs if d["kind"] == "ServiceMonitor"]
    selects = [
        m for m in monitors
        if m["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    ]  # fmt: skip
    assert len(selects) == 1, "exactly one ServiceMonitor scrapes the operator"
    assert selects[0]["spec"]["endpoints"][0]["port"] == "metrics"
    # ... and the sidecars' ServiceMonitor does not pick the operator's Service up.
    assert len(monitors) == 2


def namespace_labels(name: str, **labels: str) -> dict[str, str]:
    """A namespace's labels as the API server holds them (it sets the name label itself)."""
    return {"kubernetes.io/metadata.name": name, **labels}


@pytest.mark.parametrize(
    "values", [{}, {"operator": {"watchNamespaces": ["ml", "team-b"]}}], ids=["all", "some"]
)
def test_the_webhook_is_sent_only_the_pods_of_namespaces_that_opt_in(values):
    (webhook,) = one(render(values), "MutatingWebhookConfiguration")["webhooks"]
    selector = webhook["namespaceSelector"]
    opted_in = {"kvstrata.io/injection": "enabled"}
    assert selector_matches(selector, namespace_labels("ml", **opted_in))
    # Pods of namespaces that did not opt in are never sent: they never wait on the operator.
    assert not selector_matches(selector, namespace_labels("ml"))
    assert not selector_matches(selector, namespace_labels("ml", **{"kvstrata.io/injection": "no"}))
    for excluded in ("kube-system", RELEASE_NS):
        assert not selector_matches(selector, namespace_labels(excluded, **opted_in))


def test_an_empty_namespace_label_sends_every_namespace_but_the_excluded_ones():
    (webhook,) = one(render({"webhook": {"namespaceLabel": ""}}), "MutatingWebhookConfiguration")[
        "webhooks"
    ]
    assert "matchLabels" not in webhook["namespaceSelector"]
    assert selector_matches(webhook["namespaceSelector"], namespace_labels("ml"))
    assert not selector_matches(webhook["namespaceSelector"], namespace_labels("kube-system"))


def test_helm_refuses_a_namespace_label_without_a_value_separator():
    with pytest.raises(helm.HelmError, match="namespaceLabel"):
        render({"webhook": {"namespaceLabel": "kvstrata.io/injection"}})


@pytest.mark.parametrize("enabled", [True, False], ids=["webhook", "no-webhook"])
def test_the_operator_is_ready_only_once_it_serves_what_its_service_sends_it(enabled):
    container = operator_container(render({"webhook": {"enabled": enabled}}))
    probe = container["readinessProbe"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    if enabled:
        # The webhook Service targets the port "webhook": ready when that port listens.
        assert probe["tcpSocket"]["port"] == "webhook" and "webhook" in ports
    else:
        assert probe["httpGet"] == {"path": "/healthz", "port": "health"}


def test_the_operator_pod_is_admitted_where_the_namespace_enforces_restricted():
    template = one(render(), "Deployment")["spec"]["template"]
    assert restricted_violations({"spec": template["spec"]}) == []
