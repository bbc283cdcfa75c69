"""One admission decision for a pod, that can never deny it.

Why this module exists: kopf turns any exception a mutating handler raises
into a *denied* admission review, whatever the webhook's ``failurePolicy``
says (``Ignore`` only covers a webhook that does not answer). Injection must
never block a pod, so everything the webhook does is here, each step guarded:
deciding (reading the KVCache and the server version, rendering) ends in the
injection patch or in a patch that only adds the reason annotation; posting
the Event and counting the metric are best effort and only logged when they
fail.

Events are posted through the operator's own API client on a background
thread, not with ``kopf.event``: kopf's event queue exists only in its watch
workers' context (``posting.event_queue_loop_var``), not in the thread that
runs a synchronous admission handler, where ``kopf.event`` raises
``LookupError``. The thread also keeps a slow API server from delaying the
admission answer.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import uuid
from collections.abc import Mapping
from typing import Any

from kvstrata.operator import spec as S
from kvstrata.operator.mutate import MutationResult, mutate_pod

logger = logging.getLogger(__name__)

COMPONENT = "kvstrata-webhook"


def reason_patch(pod: Mapping[str, Any], reason: str) -> list[dict[str, Any]]:
    """JSON patch ops that only add the skip annotation ([] when even that cannot be built)."""
    try:
        meta = pod.get("metadata")
        if not isinstance(meta, Mapping):
            return []
        key = S.SKIPPED_ANNOTATION.replace("~", "~0").replace("/", "~1")
        if isinstance(meta.get("annotations"), Mapping):
            return [{"op": "add", "path": f"/metadata/annotations/{key}", "value": reason}]
        return [
            {"op": "add", "path": "/metadata/annotations", "value": {S.SKIPPED_ANNOTATION: reason}}
        ]
    except Exception:
        logger.exception("cannot build the skip annotation")
        return []


def decide(pod: Mapping[str, Any], cluster: Any, versions: Any) -> MutationResult:
    """The patch for ``pod``; never raises.

    ``cluster``: reads the KVCache; ``versions``: a
    :class:`~kvstrata.operator.serverversion.VersionCache` (None: not checked).
    """
    try:
        meta = pod.get("metadata") or {}
        name = (meta.get("annotations") or {}).get(S.CACHE_ANNOTATION)
        if name is None:
            return MutationResult(patch=[])
        namespace = meta.get("namespace") or "default"
        unsupported = versions.reason() if versions is not None else None
        kvcache, missing = None, None
        if not unsupported and isinstance(name, str) and name:
            try:
                kvcache = cluster.get(S.API_VERSION, S.KIND, namespace, name)
            except Exception as exc:  # an API hiccup must not block the pod
                missing = f"cannot read KVCache {namespace}/{name}: {exc}"
        return mutate_pod(
            pod, kvcache, namespace, missing_reason=missing, unsupported_reason=unsupported
        )
    except Exception as exc:
        logger.exception("admission failed; the pod is admitted without a sidecar")
        reason = f"internal error in the kvstrata webhook: {type(exc).__name__}: {exc}"
        return MutationResult(reason_patch(pod, reason), skipped=reason, skip_code="internal_error")


def skip_event(pod: Mapping[str, Any], namespace: str, message: str) -> dict[str, Any]:
    """A core/v1 Event on the pod saying why it got no sidecar.

    At admission a pod may have only a ``generateName`` (a ReplicaSet's) and
    no uid yet: the Event names what there is. Its own name follows the
    ``OBJECT.UNIQUE`` convention, within a DNS subdomain's 253 characters.
    """
    meta = pod.get("metadata") or {}
    pod_name = str(meta.get("name") or meta.get("generateName") or "pod")
    now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    head = pod_name[:200].rstrip("-.") or "pod"
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": f"{head}.{uuid.uuid4().hex[:16]}", "namespace": namespace},
        "involvedObject": {
            "apiVersion": "v1",
            "kind": "Pod",
            "namespace": namespace,
            "name": pod_name,
        },
        "type": "Warning",
        "reason": "InjectionSkipped",
        "message": message[:1024],
        "source": {"component": COMPONENT},
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }


def post_event(cluster: Any, event: Mapping[str, Any]) -> threading.Thread:
    """Create ``event`` on a daemon thread; a failure is logged, never raised."""

    def post() -> None:
        try:
            cluster.apply(event)
        except Exception as exc:
            logger.warning("cannot post Event %s: %s", event["metadata"]["name"], exc)

    thread = threading.Thread(target=post, name="kvstrata-event", daemon=True)
    thread.start()
    return thread


def report(
    result: MutationResult, pod: Mapping[str, Any], cluster: Any, metrics: Any, elapsed_s: float
) -> None:
    """Log line, Event and metric of one decision; each best effort, none raises."""
    meta = pod.get("metadata") or {}
    namespace = meta.get("namespace") or "default"
    cache = (meta.get("annotations") or {}).get(S.CACHE_ANNOTATION)
    if result.skipped:
        logger.warning("sidecar not injected into a pod in %s: %s", namespace, result.skipped)
        try:
            post_event(cluster, skip_event(pod, namespace, result.skipped))
        except Exception as exc:
            logger.warning("cannot post the InjectionSkipped Event: %s", exc)
    elif result.injected:
        logger.info("sidecar injected for KVCache %s/%s", namespace, cache)
    if metrics is not None and (result.injected or result.skipped):
        try:
            what = "injected" if result.injected else "skipped"
            metrics.record_admission(what, result.skip_code or "", elapsed_s)
        except Exception as exc:
            logger.warning("cannot record the admission metric: %s", exc)
