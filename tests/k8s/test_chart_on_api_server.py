"""The Helm chart's rendered manifests, created on the real API server.

helm-python-sdk renders but does not install, so the test creates what
``helm template`` gives, object by object, as ``helm install`` would: every
object (RBAC, the webhook configuration and its Service, the operator's
Deployment with its probes) must be accepted by the API server's own
validation, which no schema in the cluster-free suite fully restates.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from kvstrata.testing.chart import new_release, render

from .conftest import wait_for

pytestmark = [pytest.mark.k8s, pytest.mark.slow]


@pytest.mark.parametrize(
    "values",
    [{}, {"operator": {"watchNamespaces": ["ml"]}}, {"operator": {"replicas": 1}}],
    ids=["all", "some", "one-replica"],
)
def test_every_object_the_chart_renders_is_created_by_the_api_server(
    kube, crd_applied, peering_crds, values
):
    suffix = uuid.uuid4().hex[:6]
    release_name, namespace = f"kvs{suffix}", f"kvstrata-system-{suffix}"
    docs = render(release_name, namespace, values)
    watched = values.get("operator", {}).get("watchNamespaces", [])
    release = new_release(kube.api)
    try:
        for name in [namespace, *watched]:
            if kube.get("v1", "Namespace", "", name) is None:
                ns = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}
                release.create(ns)
        kinds = set()
        for doc in docs:
            created = release.create(doc)
            assert created.metadata.uid, f"{doc['kind']} {doc['metadata']['name']}"
            kinds.add(doc["kind"])
        assert {"Deployment", "MutatingWebhookConfiguration", "Service", "ServiceAccount"} <= kinds
        replicas = values.get("operator", {}).get("replicas", 2)
        peers = {"PodDisruptionBudget", "ClusterKopfPeering" if not watched else "KopfPeering"}
        if replicas > 1:
            assert peers <= kinds
        else:
            assert not peers & kinds
        for doc in docs:
            if doc["kind"] in ("ClusterKopfPeering", "KopfPeering"):
                assert_keeps_a_keep_alive(release.client, doc)
                assert_rbac_allows_kopfs_peering(kube, docs, doc)
    finally:
        release.uninstall()


def assert_keeps_a_keep_alive(client: Any, doc: dict[str, Any]) -> None:
    """A keep-alive patched in as kopf does it (a merge patch of status) is stored whole:
    the API server prunes nothing of it under the chart's CRD."""
    resource = client.resources.get(api_version=doc["apiVersion"], kind=doc["kind"])
    entry = {"priority": 123, "lifetime": 60, "lastseen": "2026-11-27T19:28:05.836000+00:00"}
    target = doc["metadata"].get("namespace")
    resource.patch(
        name=doc["metadata"]["name"],
        namespace=target,
        body={"status": {"kvs-kvstrata-7d9f-abcde": entry}},
        content_type="application/merge-patch+json",
    )
    stored = resource.get(name=doc["metadata"]["name"], namespace=target).to_dict()
    assert stored["status"] == {"kvs-kvstrata-7d9f-abcde": entry}


def assert_rbac_allows_kopfs_peering(
    kube: Any, docs: list[dict[str, Any]], peering: dict[str, Any]
) -> None:
    """The API server's RBAC authorizer lets the chart's ServiceAccount make every request
    kopf's peering makes (recorded from kopf's own code), and no patch of another peering."""
    import asyncio

    from kubernetes import client

    from kvstrata.testing.kopfrequests import peering_requests

    account = next(d for d in docs if d["kind"] == "ServiceAccount")["metadata"]
    user = f"system:serviceaccount:{account['namespace']}:{account['name']}"
    groups = ["system:serviceaccounts", f"system:serviceaccounts:{account['namespace']}"]
    namespace = peering["metadata"].get("namespace")
    requests = asyncio.run(
        peering_requests(
            clusterwide=namespace is None,
            name=peering["metadata"]["name"],
            namespace=namespace or "",
        )
    )
    assert requests
    authorization = client.AuthorizationV1Api(kube.api)

    def allowed(verb: str, resource: str, name: str | None) -> bool:
        attributes = {"group": "kopf.dev", "resource": resource, "verb": verb}
        attributes |= {"namespace": namespace} if namespace else {}
        attributes |= {"name": name} if name else {}
        review = {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SubjectAccessReview",
            "spec": {"user": user, "groups": groups, "resourceAttributes": attributes},
        }
        return authorization.create_subject_access_review(review).status.allowed

    for request in set(requests):
        assert request.namespace == namespace
        # RBAC objects just created reach the authorizer a moment later.
        wait_for(
            lambda r=request: allowed(r.verb, r.resource, r.name), 30, f"RBAC to allow {request}"
        )
    resource = requests[0].resource
    assert not allowed("patch", resource, "another-operators-peering")
