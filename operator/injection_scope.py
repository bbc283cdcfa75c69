"""Whether the webhook is sent the pods of a namespace, as far as the operator can tell.

Why: the API server sends the webhook only the pods of namespaces that match
its configuration's ``namespaceSelector`` (the chart's opt-in label,
``kvstrata.io/injection=enabled`` by default). Rolling an annotated workload in
a namespace without the label replaces its pods with pods the webhook never
sees: they come back without a sidecar and nothing says why. Reconcile asks
this module first and, instead of rolling, says what is missing.

Only ``matchLabels`` is checked: that is where the opt-in label is rendered;
the ``matchExpressions`` name the watched namespaces, which the operator only
reconciles anyway. When the configuration or the namespace cannot be read the
answer is "sent" (unknown is no reason to stop rolling).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvstrata.operator.cluster import Cluster

logger = logging.getLogger(__name__)

ADMISSION_API = "admissionregistration.k8s.io/v1"


def why_not_sent(cluster: Cluster, webhook_config: str | None, namespace: str) -> str | None:
    """Why the webhook is never sent this namespace's pods; None when it is (or unknown)."""
    if not webhook_config:
        return None
    try:
        config = cluster.get(ADMISSION_API, "MutatingWebhookConfiguration", "", webhook_config)
        found = cluster.get("v1", "Namespace", "", namespace)
    except Exception as exc:  # no permission, API server away: unknown, not a reason to stop
        logger.debug("injection scope of namespace %s unknown: %s", namespace, exc)
        return None
    if config is None or found is None:
        return None
    labels = (found.get("metadata") or {}).get("labels") or {}
    for webhook in config.get("webhooks") or []:
        wanted = (webhook.get("namespaceSelector") or {}).get("matchLabels") or {}
        missing = sorted(f"{k}={v}" for k, v in wanted.items() if labels.get(k) != v)
        if missing:
            return (
                f"namespace {namespace} is not labelled {', '.join(missing)}: the webhook is"
                " never sent its pods, so a rolled pod would come back without a sidecar"
            )
    return None
