"""The chart's operator replicas as kopf peers: rendered by Helm's own engine.

Two replicas by default, one reconciling (kopf peering, priority from the pod
name) and both serving the webhook, a PodDisruptionBudget, and the RBAC that
kopf's peering needs, derived from the requests kopf's peering code makes
(:mod:`kvstrata.testing.kopfrequests`), not from a list written here.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import yaml

from kvstrata.testing.apirules import selector_matches
from kvstrata.testing.kopfrequests import Request, peering_requests

from .apiserver import prune, structural_errors
from .test_chart_render import CHART, REPO, one, operator_container, rbac, render

WATCHED = {"operator": {"watchNamespaces": ["ml"]}}


def env_sources(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in operator_container(docs)["env"]}


def allows(rules: list[dict[str, Any]], request: Request) -> bool:
    """Does one of the rules grant the request, as the RBAC authorizer decides?"""
    return any(
        request.group in rule.get("apiGroups", [])
        and request.resource in rule.get("resources", [])
        and request.verb in rule["verbs"]
        and (not rule.get("resourceNames") or request.name in rule["resourceNames"])
        for rule in rules
    )


def test_by_default_two_operator_replicas_run_as_peers_behind_a_disruption_budget():
    docs = render()
    deployment = one(docs, "Deployment")
    assert deployment["spec"]["replicas"] == 2
    # A new pod is up before an old one goes: the webhook is served throughout a rollout.
    assert deployment["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    template = deployment["spec"]["template"]
    pod_labels = template["metadata"]["labels"]
    budget = one(docs, "PodDisruptionBudget")
    assert budget["spec"]["minAvailable"] == 1
    assert budget["metadata"]["namespace"] == "kvstrata-system"
    assert selector_matches(budget["spec"]["selector"], pod_labels)
    # Each replica's priority comes from its own pod name (equal priorities all pause).
    sources = env_sources(docs)
    assert sources["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert sources["POD_ID"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    peering = one(docs, "ClusterKopfPeering")
    assert sources["KVSTRATA_OPERATOR_PEERING"] == peering["metadata"]["name"]
    # Both replicas serve the webhook: its Service selects every operator pod.
    service = next(
        d for d in docs if d["kind"] == "Service" and d["spec"]["ports"][0]["name"] == "https"
    )
    assert service["spec"]["selector"].items() <= pod_labels.items()
    # The replicas spread over nodes where the scheduler can.
    (term,) = template["spec"]["affinity"]["podAntiAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"
    ]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert selector_matches(term["podAffinityTerm"]["labelSelector"], pod_labels)


def test_one_replica_runs_standalone_with_no_budget_peering_or_peering_rights():
    docs = render({"operator": {"replicas": 1}})
    deployment = one(docs, "Deployment")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    kinds = {d["kind"] for d in docs}
    assert not kinds & {"PodDisruptionBudget", "ClusterKopfPeering", "KopfPeering"}
    assert not {"KVSTRATA_OPERATOR_PEERING", "POD_NAME"} & set(env_sources(docs))
    assert "affinity" not in deployment["spec"]["template"]["spec"]
    rules = [rule for scope in rbac(docs).values() for rule in scope]
    assert not [rule for rule in rules if "kopf.dev" in rule["apiGroups"]]


def test_an_affinity_of_the_user_replaces_the_default_spread():
    mine = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [
            {"key": "pool", "operator": "In", "values": ["system"]}
        ]}]
    }}}  # fmt: skip
    template = one(render({"affinity": mine}), "Deployment")["spec"]["template"]
    assert template["spec"]["affinity"] == mine


def test_watching_some_namespaces_peers_in_each_of_them():
    docs = render({"operator": {"watchNamespaces": ["ml", "team-b"]}})
    peerings = [d for d in docs if d["kind"] == "KopfPeering"]
    assert sorted(p["metadata"]["namespace"] for p in peerings) == ["ml", "team-b"]
    assert {p["metadata"]["name"] for p in peerings} == {
        env_sources(docs)["KVSTRATA_OPERATOR_PEERING"]
    }
    assert not [d for d in docs if d["kind"] == "ClusterKopfPeering"]


@pytest.mark.parametrize("values", [{}, WATCHED], ids=["cluster-wide", "some-namespaces"])
def test_the_operator_may_make_every_request_of_kopfs_peering(values):
    docs = render(values)
    clusterwide = not values
    kind = "ClusterKopfPeering" if clusterwide else "KopfPeering"
    name = one(docs, kind)["metadata"]["name"]
    requests = asyncio.run(peering_requests(clusterwide=clusterwide, name=name))
    # kopf lists and watches the kind, and patches its keep-alive into the object.
    assert {r.verb for r in requests} >= {"list", "watch", "patch"}
    by_scope = rbac(docs)
    for request in set(requests):
        scope = "*" if request.namespace is None else request.namespace
        assert allows(by_scope.get(scope, []), request), f"the chart does not grant {request}"
    # ... and nothing beyond: list/watch of the kind, patch of this release's object only.
    kopf_rules = [
        rule for scope in by_scope.values() for rule in scope if "kopf.dev" in rule["apiGroups"]
    ]
    granted = {
        (verb, tuple(rule.get("resourceNames", [])))
        for rule in kopf_rules
        for verb in rule["verbs"]
    }
    assert granted == {("list", ()), ("watch", ()), ("patch", (name,))}


def peering_crds() -> dict[str, dict[str, Any]]:
    docs = yaml.safe_load_all((CHART / "crds" / "kopfpeering.yaml").read_text())
    return {d["spec"]["names"]["kind"]: d for d in docs}


def test_the_chart_ships_kopfs_peering_crds_as_the_repository_has_them():
    assert (CHART / "crds" / "kopfpeering.yaml").read_bytes() == (
        REPO / "crds" / "kopfpeering.yaml"
    ).read_bytes()
    crds = peering_crds()
    assert set(crds) == {"ClusterKopfPeering", "KopfPeering"}
    assert crds["ClusterKopfPeering"]["spec"]["scope"] == "Cluster"
    assert crds["KopfPeering"]["spec"]["scope"] == "Namespaced"
    for crd in crds.values():
        assert crd["spec"]["group"] == "kopf.dev"
        (version,) = crd["spec"]["versions"]
        assert version["name"] == "v1"
        # No status subresource: kopf patches the object itself, the verb granted.
        assert "status" not in (version.get("subresources") or {})


@pytest.mark.parametrize("kind", ["ClusterKopfPeering", "KopfPeering"])
def test_the_api_server_keeps_every_peers_keep_alive_in_the_status(kind):
    """A schema that pruned the peers' entries would leave each replica alone in the
    peering, and every one would reconcile."""
    (version,) = peering_crds()[kind]["spec"]["versions"]
    schema = version["schema"]["openAPIV3Schema"]
    assert structural_errors(schema) == []
    written = {
        "apiVersion": "kopf.dev/v1",
        "kind": kind,
        "metadata": {"name": "kvs-kvstrata"},
        "status": {
            "kvs-kvstrata-7d9f-abcde": {
                "priority": 123,
                "lifetime": 60,
                "lastseen": "2026-11-27T19:28:05.836000+00:00",
            }
        },
    }
    assert prune(written, schema, root=True) == written
