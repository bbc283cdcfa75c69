"""The Kubernetes API as reconcile sees it: plain dicts over the REST paths.

Why: reconcile works on plain dicts (what it renders is what it applies), so
this adapter speaks raw JSON through the ``kubernetes`` client's transport
(auth, TLS, kubeconfig or in-cluster config) instead of its generated models.
Writes are server-side apply with field manager ``kvstrata-operator`` and
``force=true``: applying the same object twice changes nothing, and fields
other managers own (``status``, defaults) are left alone.
"""

from __future__ import annotations

import json
import logging
import urllib.parse
from collections.abc import Mapping
from typing import Any

logger = logging.getLogger(__name__)

FIELD_MANAGER = "kvstrata-operator"

# (apiVersion, kind) -> (plural, namespaced)
KINDS: dict[tuple[str, str], tuple[str, bool]] = {
    ("v1", "ConfigMap"): ("configmaps", True),
    ("v1", "Secret"): ("secrets", True),
    ("v1", "Service"): ("services", True),
    ("v1", "Pod"): ("pods", True),
    ("v1", "Event"): ("events", True),
    ("v1", "Namespace"): ("namespaces", False),
    ("apps/v1", "StatefulSet"): ("statefulsets", True),
    ("apps/v1", "Deployment"): ("deployments", True),
    ("monitoring.coreos.com/v1", "ServiceMonitor"): ("servicemonitors", True),
    ("kvstrata.io/v1alpha1", "KVCache"): ("kvcaches", True),
    ("admissionregistration.k8s.io/v1", "MutatingWebhookConfiguration"): (
        "mutatingwebhookconfigurations",
        False,
    ),
    ("apiextensions.k8s.io/v1", "CustomResourceDefinition"): ("customresourcedefinitions", False),
}


def resource_path(api_version: str, kind: str, namespace: str | None, name: str | None) -> str:
    plural, namespaced = KINDS[(api_version, kind)]
    root = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    parts = [root]
    if namespaced and namespace:
        parts.append(f"/namespaces/{namespace}")
    parts.append(f"/{plural}")
    if name:
        parts.append(f"/{name}")
    return "".join(parts)


class KubeCluster:
    """:class:`kvstrata.operator.reconcile.Cluster` over a real API server."""

    def __init__(self, api_client: Any | None = None) -> None:
        from kubernetes import client, config

        if api_client is None:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            api_client = client.ApiClient()
        self.api = api_client

    def _call(
        self,
        method: str,
        path: str,
        body: Any = None,
        query: list[tuple[str, str]] | None = None,
        content_type: str = "application/json",
    ) -> dict | None:
        from kubernetes.client.exceptions import ApiException

        headers = {"Accept": "application/json", "Content-Type": content_type}
        request = self.api.param_serialize(
            method,
            path,
            query_params=query or [],
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
        )
        response = self.api.call_api(*request)
        data = response.read()
        if response.status == 404 and method == "GET":
            return None
        if not 200 <= response.status <= 299:
            raise ApiException(status=response.status, reason=f"{method} {path}: {data[:500]!r}")
        return json.loads(data) if data else {}

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict | None:
        return self._call("GET", resource_path(api_version, kind, namespace, name))

    def apply(self, obj: Mapping[str, Any]) -> dict:
        meta = obj["metadata"]
        path = resource_path(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"])
        query = [("fieldManager", FIELD_MANAGER), ("force", "true")]
        result = self._call("PATCH", path, dict(obj), query, "application/apply-patch+yaml")
        return result or {}

    def list(
        self, api_version: str, kind: str, namespace: str, label_selector: str | None = None
    ) -> list[dict]:
        query = [("labelSelector", label_selector)] if label_selector else []
        result = self._call("GET", resource_path(api_version, kind, namespace, None), None, query)
        return list((result or {}).get("items") or [])

    def patch(
        self, api_version: str, kind: str, namespace: str, name: str, body: Mapping[str, Any]
    ) -> dict:
        path = resource_path(api_version, kind, namespace, name)
        return self._call("PATCH", path, dict(body), None, "application/merge-patch+json") or {}

    def has_kind(self, api_version: str, kind: str) -> bool:
        """Is this API served (e.g. the ServiceMonitor CRD installed)?"""
        group_path = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
        found = self._call("GET", group_path)
        return any(r.get("kind") == kind for r in (found or {}).get("resources") or [])

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        quoted = urllib.parse.quote(name)
        self._call("DELETE", resource_path(api_version, kind, namespace, quoted))
