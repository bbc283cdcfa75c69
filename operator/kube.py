"""The Kubernetes API as reconcile sees it: plain dicts over the REST paths.

Why: reconcile works on plain dicts (what it renders is what it applies), so
this adapter speaks raw JSON through the ``kubernetes`` client's transport
(auth, TLS, kubeconfig or in-cluster config) instead of its generated models.
Writes are server-side apply with field manager ``kvstrata-operator`` and
``force=true``: applying the same object twice changes nothing, and fields
other managers own (``status``, defaults) are left alone.

Where the API server and the credentials come from is decided once, by
:func:`client_configuration`, for this adapter and for kopf's own
connection alike (``handlers.login``): the kubeconfig files kubectl would
read when there are any, else the pod's service account.
"""

from __future__ import annotations

import json
import logging
import os
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kubernetes.client import Configuration

logger = logging.getLogger(__name__)

FIELD_MANAGER = "kvstrata-operator"


# Where Kubernetes mounts a pod's service account (token, ca.crt, namespace).
class WriteConflict(Exception):
    """The API server refused a write with 409: another client got there first.

    Raised by :meth:`KubeCluster.create` when the object already exists and by
    :meth:`KubeCluster.replace` when the ``resourceVersion`` it carries is stale. Callers
    that race other replicas re-read and take the winner's object.
    """


SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")

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
    ("apps/v1", "ReplicaSet"): ("replicasets", True),
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


def kubeconfig_paths() -> list[Path]:
    """The kubeconfig files kubectl reads: ``$KUBECONFIG``'s list, else ``~/.kube/config``.

    Read at each call (the kubernetes package reads ``$KUBECONFIG`` once, at
    import). Files that do not exist are included; callers check.
    """
    listed = os.environ.get("KUBECONFIG", "")
    if listed:
        return [Path(p).expanduser() for p in listed.split(os.pathsep) if p]
    return [Path("~/.kube/config").expanduser()]


def in_cluster(service_account_dir: Path | None = None) -> bool:
    """Does this process run in a pod with a service account (env and token file)?"""
    directory = service_account_dir or SERVICE_ACCOUNT_DIR
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST")) and (directory / "token").is_file()


def cluster_configured() -> bool:
    """Is any cluster configured at all: a kubeconfig file, or a service account?"""
    return any(p.is_file() for p in kubeconfig_paths()) or in_cluster()


def client_configuration(service_account_dir: Path | None = None) -> Configuration:
    """A fresh client configuration for the cluster this process is pointed at.

    Like kubectl (client-go's loading rules): the kubeconfig files when any
    exists, with everything a kubeconfig can hold (token or token file,
    client certificate and key, as files or inline data, exec plugins,
    basic auth); else the pod's service account (``service_account_dir``,
    default :data:`SERVICE_ACCOUNT_DIR`), whose token is re-read as it
    rotates. The process-wide default configuration is left alone.

    Raises ``kubernetes.config.ConfigException`` when neither is there or
    the kubeconfig is unusable.
    """
    from kubernetes import client, config
    from kubernetes.config.incluster_config import InClusterConfigLoader

    configuration = client.Configuration()
    existing = [str(p) for p in kubeconfig_paths() if p.is_file()]
    if existing:
        try:
            config.load_kube_config(
                config_file=os.pathsep.join(existing), client_configuration=configuration
            )
        except config.ConfigException:
            raise
        except Exception as exc:  # malformed YAML or a wrong shape: the client raises anything
            raise config.ConfigException(
                f"kubeconfig {', '.join(existing)} is unusable: {_one_line(exc)}"
            ) from None
        _strip_token(configuration)
        return configuration
    directory = service_account_dir or SERVICE_ACCOUNT_DIR
    try:
        loader = InClusterConfigLoader(
            token_filename=str(directory / "token"), cert_filename=str(directory / "ca.crt")
        )
        loader.load_and_set(configuration)
    except config.ConfigException as exc:
        raise config.ConfigException(
            f"no kubeconfig ({', '.join(str(p) for p in kubeconfig_paths())}) "
            f"and not in a pod with a service account ({exc})"
        ) from None
    return configuration


def _one_line(exc: BaseException) -> str:
    """An exception as one line (a YAML parser's message spans several)."""
    return " ".join(str(exc).split()) or type(exc).__name__


def _strip_token(configuration: Configuration) -> None:
    """Trim the token after every refresh, as kubectl does.

    The client keeps a ``tokenFile``'s trailing newline, and an HTTP header
    cannot carry one. Its refresh hook (run before each request) rewrites the
    token, so the trim wraps the hook.
    """
    refresh = configuration.refresh_api_key_hook

    def refresh_and_strip(target: Configuration) -> None:
        if refresh is not None:
            refresh(target)
        token = target.api_key.get("BearerToken")
        if isinstance(token, str):
            target.api_key["BearerToken"] = token.strip()

    configuration.refresh_api_key_hook = refresh_and_strip


class KubeCluster:
    """:class:`kvstrata.operator.reconcile.Cluster` over a real API server."""

    def __init__(self, api_client: Any | None = None) -> None:
        from kubernetes import client

        if api_client is None:
            api_client = client.ApiClient(client_configuration())
        self.api = api_client

    def _call(
        self,
        method: str,
        path: str,
        body: Any = None,
        query: list[tuple[str, str]] | None = None,
        content_type: str = "application/json",
        conflicts: bool = False,
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
        if response.status == 409 and conflicts:
            raise WriteConflict(f"{method} {path}: {data[:300]!r}")
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

    def create(self, obj: Mapping[str, Any]) -> dict:
        """Create, or raise :class:`WriteConflict` when the object exists already.

        Unlike :meth:`apply` this never overwrites: the API server decides
        which of several racing writers wins.
        """
        meta = obj["metadata"]
        path = resource_path(obj["apiVersion"], obj["kind"], meta.get("namespace"), None)
        query = [("fieldManager", FIELD_MANAGER)]
        return self._call("POST", path, dict(obj), query, conflicts=True) or {}

    def replace(self, obj: Mapping[str, Any]) -> dict:
        """Overwrite an object read earlier; :class:`WriteConflict` when it changed since.

        ``metadata.resourceVersion`` must be the one read: the API server
        refuses a patch carrying a stale version (409) when another client
        updated the object in between. A merge patch rather than PUT, so the
        verb stays ``patch``, the one the chart already grants.
        """
        meta = obj["metadata"]
        if not meta.get("resourceVersion"):
            raise ValueError(
                f"replace of {obj['kind']} {meta['name']} needs the resourceVersion read"
            )
        path = resource_path(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"])
        query = [("fieldManager", FIELD_MANAGER)]
        body = dict(obj)
        return (
            self._call("PATCH", path, body, query, "application/merge-patch+json", conflicts=True)
            or {}
        )

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

    def server_version(self) -> dict:
        """The API server's ``/version`` (major, minor, gitVersion, ...)."""
        return self._call("GET", "/version") or {}

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        quoted = urllib.parse.quote(name)
        self._call("DELETE", resource_path(api_version, kind, namespace, quoted))
