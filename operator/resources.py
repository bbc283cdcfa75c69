"""Render the Kubernetes objects one KVCache owns, as plain dicts.

Pure functions: the same KVCache (and the same stored password) always gives
the same objects, so applying them again is a no-op. Every object carries an
owner reference to its KVCache (deletion is garbage collection) and the
``app.kubernetes.io/*`` labels.

Objects, for a KVCache ``NAME``:

* ConfigMap ``NAME-sidecar`` with ``sidecar.yaml`` (always);
* for a managed Valkey: Secret ``NAME-valkey-auth`` (key ``password``),
  headless Service ``NAME-valkey-headless``, client Service ``NAME-valkey``
  (the primary, pod 0), StatefulSet ``NAME-valkey`` (pod 0 primary, the others
  replicate it);
* headless Service ``NAME-metrics`` over the injected pods' metrics port
  (always), and ServiceMonitor ``NAME`` when
  ``spec.metrics.serviceMonitor.enabled`` (the caller drops it when its CRD
  is absent).
"""

from __future__ import annotations

import base64
import secrets
from collections.abc import Mapping
from typing import Any

from kvstrata.operator import spec as S
from kvstrata.sidecar.config import parse_quantity

MANAGED_BY = "kvstrata-operator"


def labels(name: str, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "kvstrata",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/managed-by": MANAGED_BY,
    }


def owner_reference(kvcache: Mapping[str, Any]) -> dict[str, Any]:
    meta = kvcache["metadata"]
    return {
        "apiVersion": S.API_VERSION,
        "kind": S.KIND,
        "name": meta["name"],
        "uid": meta.get("uid", ""),
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _metadata(kvcache: Mapping[str, Any], name: str, component: str) -> dict[str, Any]:
    meta = kvcache["metadata"]
    return {
        "name": name,
        "namespace": meta.get("namespace", "default"),
        "labels": labels(meta["name"], component),
        "ownerReferences": [owner_reference(kvcache)],
    }


def render_configmap(kvcache: Mapping[str, Any], config_text: str, digest: str) -> dict[str, Any]:
    meta = _metadata(kvcache, S.configmap_name(kvcache["metadata"]["name"]), "sidecar-config")
    meta["annotations"] = {S.CONFIG_HASH_ANNOTATION: digest}
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": meta,
        "data": {S.CONFIG_FILE: config_text},
    }


def new_password() -> str:
    """A fresh Valkey password (32 random bytes, URL-safe)."""
    return secrets.token_urlsafe(32)


def render_valkey_secret(kvcache: Mapping[str, Any], password: str) -> dict[str, Any]:
    name = S.valkey_auth_secret_name(kvcache["metadata"]["name"])
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _metadata(kvcache, name, "valkey"),
        "type": "Opaque",
        "data": {"password": base64.b64encode(password.encode()).decode()},
    }


def _valkey_selector(name: str) -> dict[str, str]:
    return {"app.kubernetes.io/instance": name, "app.kubernetes.io/component": "valkey"}


def render_valkey_services(kvcache: Mapping[str, Any]) -> list[dict[str, Any]]:
    name = kvcache["metadata"]["name"]
    base = S.valkey_name(name)
    port = {"name": "valkey", "port": S.VALKEY_PORT, "targetPort": "valkey", "protocol": "TCP"}
    headless = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(kvcache, f"{base}-headless", "valkey"),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": _valkey_selector(name),
            "ports": [port],
        },
    }
    # Clients talk to the primary only: pod 0 of the StatefulSet.
    primary = dict(_valkey_selector(name), **{"statefulset.kubernetes.io/pod-name": f"{base}-0"})
    client = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(kvcache, base, "valkey"),
        "spec": {"type": "ClusterIP", "selector": primary, "ports": [port]},
    }
    return [headless, client]


def _valkey_args(managed: Mapping[str, Any], auth: bool, base: str, namespace: str) -> str:
    persistence = managed.get("persistence") or {}
    parts = [
        "exec valkey-server --port 6379 --dir /data --protected-mode no",
        # A cache: when full, evict the least recently used key, never refuse writes.
        "--maxmemory-policy allkeys-lru",
        "--appendonly " + ("yes" if persistence.get("enabled") else "no"),
        '--save ""' if not persistence.get("enabled") else "--save 900 1",
    ]
    if managed.get("maxMemory"):
        parts.append(f"--maxmemory {parse_quantity(managed['maxMemory'])}")
    if auth:
        parts.append('--requirepass "$VALKEY_PASSWORD" --masterauth "$VALKEY_PASSWORD"')
    primary = f"{base}-0.{base}-headless.{namespace}.svc"
    # Pod 0 is the primary; any other ordinal replicates it.
    script = " ".join(parts)
    return (
        f'if [ "${{HOSTNAME##*-}}" != "0" ]; then REPLICA="--replicaof {primary} 6379"; fi; '
        f"{script} $REPLICA"
    )


def _valkey_container(
    kvcache: Mapping[str, Any], managed: Mapping[str, Any], auth: bool
) -> dict[str, Any]:
    meta = kvcache["metadata"]
    base = S.valkey_name(meta["name"])
    image = S.Images.from_env().valkey
    container: dict[str, Any] = {
        "name": "valkey",
        "image": managed.get("image", image.ref),
        "imagePullPolicy": image.pull_policy,
        "command": ["/bin/sh", "-c"],
        "args": [_valkey_args(managed, auth, base, meta.get("namespace", "default"))],
        "ports": [{"name": "valkey", "containerPort": S.VALKEY_PORT, "protocol": "TCP"}],
        "readinessProbe": {"tcpSocket": {"port": "valkey"}, "periodSeconds": 5},
        "livenessProbe": {
            "tcpSocket": {"port": "valkey"},
            "periodSeconds": 10,
            "failureThreshold": 6,
        },
        "resources": managed.get("resources")
        or {"requests": {"cpu": "250m", "memory": "1Gi"}, "limits": {"memory": "1Gi"}},
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 999,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": [{"name": "data", "mountPath": "/data"}],
    }
    if auth:
        secret = S.valkey_auth_secret_name(meta["name"])
        container["env"] = [
            {
                "name": "VALKEY_PASSWORD",
                "valueFrom": {"secretKeyRef": {"name": secret, "key": "password"}},
            }
        ]
    return container


def render_valkey_statefulset(kvcache: Mapping[str, Any]) -> dict[str, Any]:
    meta = kvcache["metadata"]
    name = meta["name"]
    base = S.valkey_name(name)
    managed = ((kvcache.get("spec") or {}).get("shared") or {}).get("valkey", {}).get(
        "managed"
    ) or {}
    auth = bool((managed.get("auth") or {}).get("enabled", True))
    persistence = managed.get("persistence") or {}
    pod_spec: dict[str, Any] = {
        "securityContext": {"fsGroup": 999, "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [_valkey_container(kvcache, managed, auth)],
        "enableServiceLinks": False,
    }
    sts_spec: dict[str, Any] = {
        "serviceName": f"{base}-headless",
        "replicas": int(managed.get("replicas", 1)),
        "podManagementPolicy": "OrderedReady",
        "selector": {"matchLabels": _valkey_selector(name)},
        "template": {"metadata": {"labels": labels(name, "valkey")}, "spec": pod_spec},
    }
    if persistence.get("enabled"):
        claim: dict[str, Any] = {
            "metadata": {"name": "data", "labels": labels(name, "valkey")},
            "spec": {
                "accessModes": ["ReadWriteOnce"],
                "resources": {"requests": {"storage": persistence.get("size", "8Gi")}},
            },
        }
        if persistence.get("storageClassName"):
            claim["spec"]["storageClassName"] = persistence["storageClassName"]
        sts_spec["volumeClaimTemplates"] = [claim]
    else:
        pod_spec["volumes"] = [{"name": "data", "emptyDir": {}}]
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _metadata(kvcache, base, "valkey"),
        "spec": sts_spec,
    }


def render_metrics_objects(kvcache: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A headless Service over the injected pods' metrics port, and its ServiceMonitor.

    Injected pods carry the ``kvstrata.io/cache: NAME`` label (the webhook
    adds it), which is what the Service selects.
    """
    name = kvcache["metadata"]["name"]
    port = ((kvcache.get("spec") or {}).get("metrics") or {}).get("port", S.DEFAULT_METRICS_PORT)
    monitor = ((kvcache.get("spec") or {}).get("metrics") or {}).get("serviceMonitor") or {}
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(kvcache, f"{name}-metrics", "metrics"),
        "spec": {
            "clusterIP": "None",
            "selector": {S.CACHE_LABEL: name},
            "ports": [{"name": "metrics", "port": port, "targetPort": "kvstrata-metrics"}],
        },
    }
    meta = _metadata(kvcache, name, "metrics")
    meta["labels"].update(monitor.get("labels") or {})
    endpoint = {"port": "metrics", "path": "/metrics", "interval": monitor.get("interval", "30s")}
    service_monitor = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": meta,
        "spec": {
            "selector": {"matchLabels": labels(name, "metrics")},
            "namespaceSelector": {"matchNames": [kvcache["metadata"].get("namespace", "default")]},
            "endpoints": [endpoint],
        },
    }
    return [service, service_monitor]
