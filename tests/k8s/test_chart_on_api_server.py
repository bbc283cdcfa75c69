"""The Helm chart's rendered manifests, created on the real API server.

helm-python-sdk renders but does not install, so the test creates what
``helm template`` gives, object by object, as ``helm install`` would: every
object (RBAC, the webhook configuration and its Service, the operator's
Deployment with its probes) must be accepted by the API server's own
validation, which no schema in the cluster-free suite fully restates.
"""

from __future__ import annotations

import uuid

import pytest

from kvstrata.testing.chart import new_release, render

pytestmark = [pytest.mark.k8s, pytest.mark.slow]


@pytest.mark.parametrize(
    "values", [{}, {"operator": {"watchNamespaces": ["ml"]}}], ids=["all", "some"]
)
def test_every_object_the_chart_renders_is_created_by_the_api_server(kube, crd_applied, values):
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
    finally:
        release.uninstall()
