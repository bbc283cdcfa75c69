"""A workload in a namespace that has not opted in is not rolled, on the real API server.

Reconcile runs here against the real API server (the operator's pass, called
directly, so that the session's running operator, which watches another
namespace, is not involved): the webhook configuration carries the chart's
opt-in label as its namespaceSelector, the namespace lacks it, and the
Deployment is left unstamped with a Warning Event the API server accepted;
once the namespace is labelled, the next pass rolls it.
"""

from __future__ import annotations

import uuid

import pytest

from kvstrata.operator import spec as S
from kvstrata.operator.reconcile import reconcile

from .conftest import ADMISSION
from .test_operator_on_cluster import deployment, kvcache

pytestmark = [pytest.mark.k8s]

OPT_IN = {"kvstrata.io/injection": "enabled"}


def opt_in_webhook(name: str) -> dict:
    """The chart's selector; an objectSelector nothing matches, so no pod is ever sent."""
    return {
        "apiVersion": ADMISSION,
        "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": name},
        "webhooks": [
            {
                "name": "inject.kvstrata.io",
                "admissionReviewVersions": ["v1"],
                "sideEffects": "None",
                "failurePolicy": "Ignore",
                "clientConfig": {"url": "https://127.0.0.1:9/inject"},
                "rules": [
                    {
                        "apiGroups": [""],
                        "apiVersions": ["v1"],
                        "operations": ["CREATE"],
                        "resources": ["pods"],
                    }
                ],
                "namespaceSelector": {"matchLabels": OPT_IN},
                "objectSelector": {"matchLabels": {"kvstrata.test/never": "sent"}},
            }
        ],
    }


def stamp(kube, namespace: str, name: str) -> str | None:
    found = kube.get("apps/v1", "Deployment", namespace, name)
    return (found["spec"]["template"]["metadata"].get("annotations") or {}).get(
        S.CONFIG_HASH_ANNOTATION
    )


def test_a_deployment_of_a_namespace_without_the_opt_in_label_is_not_rolled(kube, crd_applied):
    suffix = uuid.uuid4().hex[:6]
    namespace, config, cache = f"optin-{suffix}", f"optin-{suffix}", "demo"
    kube.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
    kube.apply(opt_in_webhook(config))
    try:
        kube.apply(kvcache(cache, namespace))
        kube.apply(deployment("llama", namespace, cache))
        current = kube.get(S.API_VERSION, S.KIND, namespace, cache)
        outcome = reconcile(current, kube, webhook_config=config)
        assert stamp(kube, namespace, "llama") is None
        assert outcome.status["notRolled"] == ["Deployment/llama"]
        events = [
            e
            for e in kube.list("v1", "Event", namespace)
            if e["involvedObject"].get("name") == "llama" and e["reason"] == "NamespaceNotOptedIn"
        ]
        assert len(events) == 1 and "kvstrata.io/injection=enabled" in events[0]["message"]
        assert events[0]["involvedObject"]["kind"] == "Deployment"
        # The namespace opts in: the next pass rolls the Deployment.
        kube.patch("v1", "Namespace", "", namespace, {"metadata": {"labels": OPT_IN}})
        again = reconcile(current, kube, webhook_config=config)
        assert stamp(kube, namespace, "llama") == again.status["configHash"]
        assert again.status["notRolled"] == []
    finally:
        kube.delete(ADMISSION, "MutatingWebhookConfiguration", "", config)
        kube.delete("v1", "Namespace", "", namespace)
