"""Roll the workloads that use a KVCache, so that their pods get its current sidecar.

Why this module exists: the webhook injects a pod only when the pod is
created, so a config change reaches running workloads only by replacing their
pods, and so does a pod the webhook never saw. Both are decided here, per
workload, from its pod template and its pods:

* the template lacks the config hash of the KVCache's current config, and
  some pod does not run it (a config change, or pods made before the KVCache):
  the hash is stamped on the template, and the Deployment or StatefulSet
  controller replaces the pods;
* the template has the current hash, yet pods made from that very template
  carry neither the sidecar nor the webhook's skip reason: the API server
  admitted them without calling the webhook (``failurePolicy: Ignore`` while
  the operator was down, or before its Service had an endpoint again). These
  are rolled once more, with a re-roll count on the template
  (``kvstrata.io/reroll``: what changes the template, and what tells this
  template's pods from the previous one's). At most :data:`MAX_REROLLS` per
  config: a webhook the API server can never reach must not keep the
  workload rolling for ever.

What the template carries, as the operator writes it::

    spec.template.metadata.annotations:
      kvstrata.io/cache: demo                  # the user's: asks for the sidecar
      kvstrata.io/config-hash: 9f1c2e0a7b3d4c5e  # the config the pods should run
      kvstrata.io/reroll: "1"                  # only after a re-roll; dropped by a config roll

Pods copy the template's annotations, so a pod made from the current template
has the same ``config-hash`` and ``reroll`` values.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvstrata.operator import spec as S
from kvstrata.operator.cluster import Cluster, Event
from kvstrata.operator.injection_scope import why_not_sent

WORKLOAD_KINDS = ("Deployment", "StatefulSet")
MAX_REROLLS = 3


def roll_workloads(
    cluster: Cluster,
    namespace: str,
    name: str,
    digest: str,
    events: list[Event],
    webhook_config: str | None = None,
    skipped: list[str] | None = None,
) -> int:
    """Roll every workload whose pod template asks for this cache and whose pods need it.

    A workload whose pods all run the current config already (created after
    the KVCache, so injected with it) is left alone; one whose pods predate
    the KVCache (admitted without a sidecar) is rolled; so is one whose
    current pods the webhook never saw (see the module's docstring).
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
            annotations = _template_annotations(workload)
            if annotations.get(S.CACHE_ANNOTATION) != name:
                continue
            stamp = _stamp(cluster, namespace, workload, annotations, digest)
            if stamp is None:
                continue
            wname = workload["metadata"]["name"]
            if not scope_checked:
                not_sent, scope_checked = why_not_sent(cluster, webhook_config, namespace), True
            if not_sent is not None:
                _skip(cluster, kind, workload, not_sent, events)
                if skipped is not None:
                    skipped.append(f"{kind}/{wname}")
                continue
            body = {"spec": {"template": {"metadata": {"annotations": stamp}}}}
            cluster.patch("apps/v1", kind, namespace, wname, body)
            rolled += 1
            reroll = stamp[S.REROLL_ANNOTATION]
            why = f", re-roll {reroll}: pods admitted without the webhook" if reroll else ""
            message = f"{kind} {wname}: config {digest}{why}"
            events.append(Event("Normal", "RolledWorkload", message))
    return rolled


def _template_annotations(workload: Mapping[str, Any]) -> dict[str, str]:
    template = ((workload.get("spec") or {}).get("template") or {}).get("metadata") or {}
    return dict(template.get("annotations") or {})


def _stamp(
    cluster: Cluster,
    namespace: str,
    workload: Mapping[str, Any],
    annotations: Mapping[str, str],
    digest: str,
) -> dict[str, str | None] | None:
    """The annotations that roll the workload (None: leave it as it is).

    ``None`` as an annotation's value removes it (a JSON merge patch).
    """
    if annotations.get(S.CONFIG_HASH_ANNOTATION) != digest:
        if _pods_current(cluster, namespace, workload, digest):
            return None
        return {S.CONFIG_HASH_ANNOTATION: digest, S.REROLL_ANNOTATION: None}
    rerolls = _reroll_count(annotations)
    if rerolls >= MAX_REROLLS or not _unseen_pods(cluster, namespace, workload, annotations):
        return None
    return {S.CONFIG_HASH_ANNOTATION: digest, S.REROLL_ANNOTATION: str(rerolls + 1)}


def _reroll_count(annotations: Mapping[str, str]) -> int:
    value = annotations.get(S.REROLL_ANNOTATION) or "0"
    return int(value) if value.isdigit() else MAX_REROLLS  # not ours to interpret: stop


def _pods(cluster: Cluster, namespace: str, workload: Mapping[str, Any]) -> list[dict] | None:
    """The workload's pods (None when its selector is not plain ``matchLabels``)."""
    selector = ((workload.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
    if not selector:
        return None
    query = ",".join(f"{k}={v}" for k, v in sorted(selector.items()))
    return cluster.list("v1", "Pod", namespace, query)


def _pods_current(
    cluster: Cluster, namespace: str, workload: Mapping[str, Any], digest: str
) -> bool:
    """Do the workload's pods exist and all carry the sidecar of config ``digest``?"""
    pods = _pods(cluster, namespace, workload)
    return bool(pods) and all(
        ((p.get("metadata") or {}).get("annotations") or {}).get(S.INJECTED_ANNOTATION) == digest
        for p in pods or []
    )


def _unseen_pods(
    cluster: Cluster, namespace: str, workload: Mapping[str, Any], template: Mapping[str, str]
) -> list[str]:
    """The live pods made from this very template that the webhook never answered for."""
    unseen = []
    for pod in _pods(cluster, namespace, workload) or []:
        meta = pod.get("metadata") or {}
        annotations = meta.get("annotations") or {}
        if meta.get("deletionTimestamp"):
            continue
        from_template = all(
            annotations.get(key) == template.get(key)
            for key in (S.CONFIG_HASH_ANNOTATION, S.REROLL_ANNOTATION)
        )
        answered = S.INJECTED_ANNOTATION in annotations or S.SKIPPED_ANNOTATION in annotations
        if from_template and not answered:
            unseen.append(str(meta.get("name")))
    return unseen


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
