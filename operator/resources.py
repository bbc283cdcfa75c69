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

Each ``NAME-SUFFIX`` is shortened with a hash of NAME where it would be too
long or otherwise illegal for its kind (:mod:`kvstrata.operator.names`).
"""

from __future__ import annotations

import base64
import copy
import secrets
import shlex
from typing import Any

from kvstrata.operator import names
from kvstrata.operator import spec as S
from kvstrata.operator.model import (
    PASSWORD_KEY,
    KVCache,
    KVCacheLike,
    ManagedValkey,
    ServiceMonitorSpec,
)
from kvstrata.sidecar.config import parse_quantity

MANAGED_BY = "kvstrata-operator"


def labels(name: str, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "kvstrata",
        "app.kubernetes.io/instance": names.label_value(name),
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/managed-by": MANAGED_BY,
    }


def owner_reference(kvcache: KVCache) -> dict[str, Any]:
    return {
        "apiVersion": S.API_VERSION,
        "kind": S.KIND,
        "name": kvcache.name,
        "uid": kvcache.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _metadata(kvcache: KVCache, name: str, component: str) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": kvcache.namespace,
        "labels": labels(kvcache.name, component),
        "ownerReferences": [owner_reference(kvcache)],
    }


def secret_metadata(kvcache: KVCache, name: str, component: str) -> dict[str, Any]:
    """Metadata of a Secret this KVCache owns (deleted with it)."""
    return _metadata(kvcache, name, component)


def render_configmap(kvcache: KVCacheLike, config_text: str, digest: str) -> dict[str, Any]:
    kvcache = KVCache.parse(kvcache)
    meta = _metadata(kvcache, S.configmap_name(kvcache.name), "sidecar-config")
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


def render_valkey_secret(kvcache: KVCacheLike, password: str) -> dict[str, Any]:
    kvcache = KVCache.parse(kvcache)
    name = S.valkey_auth_secret_name(kvcache.name)
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _metadata(kvcache, name, "valkey"),
        "type": "Opaque",
        "data": {PASSWORD_KEY: base64.b64encode(password.encode()).decode()},
    }


def _valkey_selector(name: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/instance": names.label_value(name),
        "app.kubernetes.io/component": "valkey",
    }


def render_valkey_services(kvcache: KVCacheLike) -> list[dict[str, Any]]:
    kvcache = KVCache.parse(kvcache)
    name = kvcache.name
    base = S.valkey_name(name)
    port = {"name": "valkey", "port": S.VALKEY_PORT, "targetPort": "valkey", "protocol": "TCP"}
    headless = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(kvcache, S.valkey_headless_name(name), "valkey"),
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


def valkey_acl_args(key_prefix: str) -> str:
    """valkey-server arguments (shell text; the password from ``$VALKEY_PASSWORD``)
    for the managed Valkey's ACL users.

    No anonymous access (``default`` off); the sidecars' user may run the data
    commands (``+@all -@dangerous``: no FLUSHALL, KEYS, CONFIG, DEBUG ...) on
    keys under the cache's prefix only; replicas authenticate as a user that
    may only replicate.
    """
    keys = shlex.quote(f"~{key_prefix}*")
    return " ".join(
        [
            "--user default off",
            f'--user {S.MANAGED_VALKEY_USER} on ">$VALKEY_PASSWORD" {keys} +@all -@dangerous',
            f'--user {S.MANAGED_VALKEY_REPLICA_USER} on ">$VALKEY_PASSWORD" +psync +replconf +ping',
            f'--masteruser {S.MANAGED_VALKEY_REPLICA_USER} --masterauth "$VALKEY_PASSWORD"',
        ]
    )


def _valkey_args(managed: ManagedValkey, base: str, namespace: str, key_prefix: str) -> str:
    persistent = managed.persistence_or_default.enabled
    parts = [
        "exec valkey-server --port 6379 --dir /data --protected-mode no",
        # A cache: when full, evict the least recently used key, never refuse writes.
        "--maxmemory-policy allkeys-lru",
        "--appendonly " + ("yes" if persistent else "no"),
        '--save ""' if not persistent else "--save 900 1",
    ]
    if managed.max_memory:
        parts.append(f"--maxmemory {parse_quantity(managed.max_memory)}")
    if managed.auth_enabled:
        parts.append(valkey_acl_args(key_prefix))
    primary = f"{base}-0.{base}-headless.{namespace}.svc"  # base-headless: valkey_headless_name
    # Pod 0 is the primary; any other ordinal replicates it.
    script = " ".join(parts)
    return (
        f'if [ "${{HOSTNAME##*-}}" != "0" ]; then REPLICA="--replicaof {primary} 6379"; fi; '
        f"{script} $REPLICA"
    )


def _valkey_container(kvcache: KVCache, managed: ManagedValkey) -> dict[str, Any]:
    base = S.valkey_name(kvcache.name)
    image = S.Images.from_env().valkey
    container: dict[str, Any] = {
        "name": "valkey",
        "image": managed.image if managed.image is not None else image.ref,
        "imagePullPolicy": image.pull_policy,
        "command": ["/bin/sh", "-c"],
        "args": [_valkey_args(managed, base, kvcache.namespace, S.valkey_key_prefix(kvcache))],
        "ports": [{"name": "valkey", "containerPort": S.VALKEY_PORT, "protocol": "TCP"}],
        "readinessProbe": {"tcpSocket": {"port": "valkey"}, "periodSeconds": 5},
        "livenessProbe": {
            "tcpSocket": {"port": "valkey"},
            "periodSeconds": 10,
            "failureThreshold": 6,
        },
        "resources": copy.deepcopy(managed.resources)
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
    if managed.auth_enabled:
        secret = S.valkey_auth_secret_name(kvcache.name)
        container["env"] = [
            {
                "name": "VALKEY_PASSWORD",
                "valueFrom": {"secretKeyRef": {"name": secret, "key": PASSWORD_KEY}},
            }
        ]
    return container


def render_valkey_statefulset(kvcache: KVCacheLike) -> dict[str, Any]:
    kvcache = KVCache.parse(kvcache)
    name = kvcache.name
    base = S.valkey_name(name)
    managed = kvcache.spec.shared.managed_valkey
    persistence = managed.persistence_or_default
    pod_spec: dict[str, Any] = {
        "securityContext": {"fsGroup": 999, "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [_valkey_container(kvcache, managed)],
        "enableServiceLinks": False,
    }
    sts_spec: dict[str, Any] = {
        "serviceName": S.valkey_headless_name(name),
        "replicas": managed.replicas,
        "podManagementPolicy": "OrderedReady",
        "selector": {"matchLabels": _valkey_selector(name)},
        "template": {"metadata": {"labels": labels(name, "valkey")}, "spec": pod_spec},
    }
    if persistence.enabled:
        claim: dict[str, Any] = {
            "metadata": {"name": "data", "labels": labels(name, "valkey")},
            "spec": {
                "accessModes": ["ReadWriteOnce"],
                "resources": {"requests": {"storage": persistence.size}},
            },
        }
        if persistence.storage_class_name:
            claim["spec"]["storageClassName"] = persistence.storage_class_name
        sts_spec["volumeClaimTemplates"] = [claim]
    else:
        pod_spec["volumes"] = [{"name": "data", "emptyDir": {}}]
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _metadata(kvcache, base, "valkey"),
        "spec": sts_spec,
    }


# Prometheus's name for the pod label kvstrata.io/cache (the KVCache's name).
KVCACHE_SOURCE_LABEL = "__meta_kubernetes_pod_label_kvstrata_io_cache"


def render_metrics_objects(kvcache: KVCacheLike) -> list[dict[str, Any]]:
    """A headless Service over the injected pods' metrics port, and its ServiceMonitor.

    Injected pods carry the ``kvstrata.io/cache: NAME`` label (the webhook
    adds it), which is what the Service selects.
    """
    kvcache = KVCache.parse(kvcache)
    name = kvcache.name
    metrics = kvcache.spec.metrics
    monitor = metrics.service_monitor or ServiceMonitorSpec()
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(kvcache, S.metrics_service_name(name), "metrics"),
        "spec": {
            "clusterIP": "None",
            "selector": {S.CACHE_LABEL: S.cache_label_value(name)},
            "ports": [{"name": "metrics", "port": metrics.port, "targetPort": S.METRICS_PORT_NAME}],
        },
    }
    meta = _metadata(kvcache, name, "metrics")
    meta["labels"].update(monitor.labels or {})
    endpoint = {
        "port": "metrics",
        "path": "/metrics",
        "interval": monitor.interval,
        # The series carry the KVCache's name, as with the chart's ServiceMonitor.
        "relabelings": [{"sourceLabels": [KVCACHE_SOURCE_LABEL], "targetLabel": "kvcache"}],
    }
    service_monitor = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": meta,
        "spec": {
            "selector": {"matchLabels": labels(name, "metrics")},
            "namespaceSelector": {"matchNames": [kvcache.namespace]},
            "endpoints": [endpoint],
        },
    }
    return [service, service_monitor]
