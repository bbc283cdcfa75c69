"""Roll the workloads of a KVCache onto its config: stamp the config hash on their pod templates.

Why a module of its own: rolling replaces a user's pods, so which workloads
are rolled is decided with care, apart from rendering and reporting: only
those whose pod template asks for this cache, not those already on the
config (by the template's hash or by every pod's injected one), and none
in a namespace whose pods the webhook is never sent
(:mod:`kvstrata.operator.injection_scope`): their new pods would come back
without a sidecar, so those get a Warning Event on the workload instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvstrata.operator import spec as S
from kvstrata.operator.cluster import Cluster, Event
from kvstrata.operator.injection_scope import why_not_sent

__all__ = ["WORKLOAD_KINDS", "roll_workloads"]

WORKLOAD_KINDS = ("Deployment", "StatefulSet")


def roll_workloads(
    cluster: Cluster,
    namespace: str,
    name: str,
    digest: str,
    events: list[Event],
    webhook_config: str | None = None,
    skipped: list[str] | None = None,
) -> int:
    """Stamp the config hash on every workload whose pod template asks for this cache.

    A changed annotation on the pod template is what makes the Deployment or
    StatefulSet controller replace its pods, which the webhook then injects
    with the new config. A workload whose pods all run the current config
    already (created after the KVCache, so injected with it) is left alone;
    one whose pods predate the KVCache (admitted without a sidecar) is rolled.
    Returns how many workloads were rolled. In a namespace whose pods the
    webhook is never sent (see :mod:`kvstrata.operator.injection_scope`) a
    workload is not rolled: its new pods would lack the sidecar. It gets a
    Warning Event and is named in ``skipped`` instead.
    """
    rolled = 0
    not_sent: str | None = None
    scope_checked = False
    for kind in WORKLOAD_KINDS:
        for workload in cluster.list("apps/v1", kind, namespace):
            template_meta = ((workload.get("spec") or {}).get("template") or {}).get(
                "metadata"
            ) or {}
            annotations = template_meta.get("annotations") or {}
            if annotations.get(S.CACHE_ANNOTATION) != name:
                continue
            if annotations.get(S.CONFIG_HASH_ANNOTATION) == digest:
                continue
            if _pods_current(cluster, namespace, workload, digest):
                continue
            wname = workload["metadata"]["name"]
            if not scope_checked:
                not_sent, scope_checked = why_not_sent(cluster, webhook_config, namespace), True
            if not_sent is not None:
                _skip(cluster, kind, workload, not_sent, events)
                if skipped is not None:
                    skipped.append(f"{kind}/{wname}")
                continue
            body = {
                "spec": {
                    "template": {"metadata": {"annotations": {S.CONFIG_HASH_ANNOTATION: digest}}}
                }
            }
            cluster.patch("apps/v1", kind, namespace, wname, body)
            rolled += 1
            events.append(Event("Normal", "RolledWorkload", f"{kind} {wname}: config {digest}"))
    return rolled


def _skip(
    cluster: Cluster, kind: str, workload: Mapping[str, Any], why: str, events: list[Event]
) -> None:
    """Say on the workload itself, where its owner looks, why it was not rolled."""
    meta = workload["metadata"]
    message = f"not rolled to the KVCache's config: {why}"
    events.append(Event("Warning", "NamespaceNotOptedIn", f"{kind} {meta['name']} {message}"))
    cluster.apply(
        {
            "apiVersion": "v1",
            "kind": "Event",
            # One Event per workload and reason, updated by each pass, not one per pass.
            "metadata": {
                "name": f"{meta['name']}.kvstrata-not-opted-in",
                "namespace": meta["namespace"],
            },
            "involvedObject": {
                "apiVersion": "apps/v1",
                "kind": kind,
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta.get("uid"),
            },
            "type": "Warning",
            "reason": "NamespaceNotOptedIn",
            "message": message,
            "source": {"component": "kvstrata-operator"},
        }
    )


def _pods_current(
    cluster: Cluster, namespace: str, workload: Mapping[str, Any], digest: str
) -> bool:
    """Do the workload's pods exist and all carry the sidecar of config ``digest``?"""
    selector = ((workload.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
    if not selector:
        return False
    query = ",".join(f"{k}={v}" for k, v in sorted(selector.items()))
    pods = cluster.list("v1", "Pod", namespace, query)
    return bool(pods) and all(
        ((p.get("metadata") or {}).get("annotations") or {}).get(S.INJECTED_ANNOTATION) == digest
        for p in pods
    )
