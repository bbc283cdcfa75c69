"""kopf handlers: thin glue from kopf's causes to the plain functions.

Why this module exists: kopf wants module-level handler functions; the
decisions live in :mod:`~kvstrata.operator.reconcile` and
:mod:`~kvstrata.operator.mutate`. Handlers are attached to a registry by
:func:`register` (called from ``kvstrata operator``), never at import, so
importing this module has no side effect.

kopf's connection to the API server comes from :func:`login`, the same
configuration :class:`~kvstrata.operator.kube.KubeCluster` uses: kopf only
brings login handlers of its own on the registry it builds itself, and
:func:`register` fills a fresh one.

Shared state lives in kopf's ``memo`` (set up by :func:`configure`):
``memo.cluster`` (a :class:`~kvstrata.operator.reconcile.Cluster`),
``memo.options`` (the parsed command line) and optionally ``memo.metrics``.
Events about a KVCache are posted with ``kopf.event`` (from its watch
handlers, where kopf's event queue exists); the webhook's own through the
cluster client (:mod:`~kvstrata.operator.admission`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import jsonpatch
import kopf

from kvstrata.operator import admission, kube
from kvstrata.operator import spec as S
from kvstrata.operator.metrics import observe_outcome
from kvstrata.operator.reconcile import Outcome, reconcile
from kvstrata.operator.serverversion import VersionCache
from kvstrata.operator.webhook_tls import WebhookTLSOptions, ensure_serving_tls

logger = logging.getLogger(__name__)

WEBHOOK_ID = "inject"  # the webhook URL path: https://SERVICE:PORT/inject
RECHECK_INTERVAL_S = 60.0  # timer: status refresh, drift repair
CERT_CHECK_INTERVAL_S = 6 * 3600.0


class NamespacedWebhookServer(kopf.WebhookServer):
    """kopf's HTTPS server, filling the pod's namespace from the admission request.

    A pod submitted as ``kubectl -n NS create -f pod.yaml`` may reach the
    webhook without ``metadata.namespace``; the review's ``request.namespace``
    always has it.
    """

    async def __call__(self, fn: Any) -> AsyncIterator[Any]:
        async def with_namespace(request: dict, **kwargs: Any) -> Any:
            review = request.get("request") or {}
            obj = review.get("object")
            if isinstance(obj, dict) and review.get("namespace"):
                obj.setdefault("metadata", {}).setdefault("namespace", review["namespace"])
            return await fn(request, **kwargs)

        async for client_config in super().__call__(with_namespace):
            yield client_config


def login(logger: logging.Logger, **_: Any) -> kopf.ConnectionInfo:
    """Login: kopf's credentials, from :func:`kvstrata.operator.kube.client_configuration`.

    Called by kopf at startup and again whenever the API server answers 401,
    so a rotated service-account token or an expired exec credential is
    fetched afresh. Raises ``kubernetes.config.ConfigException`` when no
    cluster is configured.
    """
    configuration = kube.client_configuration()
    logger.debug("logging in to %s", configuration.host)
    return connection_info(configuration)


def connection_info(configuration: Any) -> kopf.ConnectionInfo:
    """kopf's view of a ``kubernetes.client.Configuration``: server, CA, credentials.

    The bearer token (kubeconfig token or token file, exec plugin, service
    account) or basic-auth header comes from ``get_api_key_with_prefix``,
    which runs the client's refresh hook first; client certificates are the
    files the client wrote (inline ``*-data`` and exec-plugin certificates
    become temporary files that live as long as the process).
    """
    header = configuration.get_api_key_with_prefix("BearerToken") or ""
    scheme, _, token = header.partition(" ") if " " in header else ("", "", header)
    if scheme.lower() == "bearer":
        scheme = "Bearer"  # the in-cluster loader writes "bearer"
    return kopf.ConnectionInfo(
        server=configuration.host,
        ca_path=configuration.ssl_ca_cert or None,
        insecure=not configuration.verify_ssl,
        scheme=scheme or None,
        token=token or None,
        certificate_path=configuration.cert_file or None,
        private_key_path=configuration.key_file or None,
    )


def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    """Startup: storage of kopf's own state, webhook server, the cluster client."""
    options = memo.options
    # Keep kopf's bookkeeping in annotations: our status schema is structural
    # and would prune ``status.kopf``.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="kvstrata.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="kvstrata.io", key="last-handled-configuration"
    )
    settings.posting.level = logging.INFO
    settings.admission.managed = None  # the chart owns the MutatingWebhookConfiguration
    if options.webhook_port:
        cert_dir = Path(options.cert_dir)
        settings.admission.server = NamespacedWebhookServer(
            addr="0.0.0.0",
            port=options.webhook_port,
            certfile=str(cert_dir / "tls.crt"),
            pkeyfile=str(cert_dir / "tls.key"),
        )
    if getattr(memo, "cluster", None) is None:
        from kvstrata.operator.kube import KubeCluster

        memo.cluster = KubeCluster()


async def manage_certificate(memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    """Startup: issue or load the serving certificate, then re-check it periodically."""
    options = memo.options
    if not options.webhook_port or options.cert_manager:
        return
    tls = WebhookTLSOptions(
        namespace=options.namespace,
        secret_name=options.webhook_secret,
        service_name=options.webhook_service,
        webhook_config=options.webhook_config,
        cert_dir=Path(options.cert_dir),
    )
    done = await asyncio.to_thread(ensure_serving_tls, memo.cluster, tls)
    logger.info("webhook certificate: %s", done)

    async def recheck() -> None:
        while True:
            await asyncio.sleep(CERT_CHECK_INTERVAL_S)
            try:
                done = await asyncio.to_thread(ensure_serving_tls, memo.cluster, tls)
                logger.info("webhook certificate: %s", done)
            except Exception as exc:  # keep serving the current one; try again later
                logger.warning("webhook certificate check failed: %s", exc)

    memo.cert_task = asyncio.get_running_loop().create_task(recheck())


def _report(body: kopf.Body, patch: kopf.Patch, outcome: Outcome) -> None:
    """Status into the patch, Events posted, then kopf told whether and when to retry."""
    patch.status.update(outcome.status)
    for event in outcome.events:
        kopf.event(body, type=event.type, reason=event.reason, message=event.message)
    if outcome.permanent:
        raise kopf.PermanentError(outcome.permanent)
    if outcome.retry_after is not None:
        ready = next(c for c in outcome.status["conditions"] if c["type"] == "Ready")
        raise kopf.TemporaryError(ready["message"], delay=outcome.retry_after)


def _reconcile_measured(body: kopf.Body, memo: Any) -> Outcome:
    """One reconcile pass, counted and timed in the operator's metrics (when it has them)."""
    metrics = getattr(memo, "metrics", None)
    started = time.perf_counter()
    try:
        # The webhook configuration tells which namespaces' pods it is sent:
        # workloads elsewhere are not rolled (their new pods would lack a sidecar).
        options = getattr(memo, "options", None)
        webhook_config = getattr(options, "webhook_config", None)
        outcome = reconcile(_raw(body), memo.cluster, webhook_config=webhook_config)
    except Exception:
        if metrics is not None:
            metrics.record_reconcile("error", time.perf_counter() - started)
        raise
    if metrics is not None:
        observe_outcome(metrics, dict(body.get("metadata") or {}), outcome, started)
    return outcome


def reconcile_kvcache(
    body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, logger: logging.Logger, **_: Any
) -> None:
    """Create/update/resume: render, apply, check, report (see reconcile's docstring)."""
    outcome = _reconcile_measured(body, memo)
    logger.debug("reconciled: %s", outcome.status.get("conditions"))
    _report(body, patch, outcome)


def recheck_kvcache(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, **_: Any) -> None:
    """Timer: the same pass, so status follows pods and shared tiers, and drift is undone."""
    outcome = _reconcile_measured(body, memo)
    if outcome.permanent:  # already reported by the change handler
        patch.status.update(outcome.status)
        return
    _report(body, patch, outcome)


def forget_kvcache(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """Delete: drop the KVCache's per-object metric series (owned objects go by GC)."""
    metrics = getattr(memo, "metrics", None)
    if metrics is not None:
        meta = body.get("metadata") or {}
        metrics.forget_kvcache(meta.get("namespace") or "default", meta.get("name") or "")


def inject_sidecar(
    body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, logger: logging.Logger, **_: Any
) -> None:
    """Mutating webhook for Pod CREATE; never refuses a pod (skips with a reason).

    Raising here would make kopf deny the pod, so nothing does: the steps
    are guarded in :mod:`~kvstrata.operator.admission`, and this last net
    admits the pod unchanged should anything else fail.
    """
    try:
        started = time.perf_counter()
        pod = _raw(body)
        cluster = getattr(memo, "cluster", None)
        result = admission.decide(pod, cluster, _versions(memo))
        if result.patch:
            patch.fns.append(functools.partial(_apply_ops, result.patch))
        admission.report(result, pod, cluster, getattr(memo, "metrics", None), _since(started))
    except Exception:
        logger.exception("admission failed; the pod is admitted unchanged")
        patch.fns.clear()


def _since(started: float) -> float:
    return time.perf_counter() - started


def _versions(memo: kopf.Memo) -> VersionCache | None:
    """The API server's version, cached in ``memo`` (None: a cluster that cannot say)."""
    versions = getattr(memo, "server_versions", None)
    if versions is None:
        fetch = getattr(getattr(memo, "cluster", None), "server_version", None)
        if fetch is None:
            return None
        versions = memo.server_versions = VersionCache(fetch)
    return versions


def _apply_ops(ops: list[dict[str, Any]], raw: dict[str, Any]) -> None:
    """Apply the decided ops to kopf's copy of the pod; a failure leaves the pod as it was."""
    try:
        patched = jsonpatch.apply_patch(raw, ops)
    except Exception:
        logging.getLogger(__name__).exception("cannot apply the pod patch; pod left unchanged")
        return
    raw.clear()
    raw.update(patched)


def _raw(body: Any) -> dict[str, Any]:
    return dict(body)


def register(registry: kopf.OperatorRegistry, webhook: bool = True) -> None:
    """Attach every handler, login included, to ``registry`` (admission only with ``webhook``)."""
    kvcaches = dict(group=S.GROUP, version=S.VERSION, plural=S.PLURAL, registry=registry)
    kopf.on.login(registry=registry, id="kubeconfig-or-service-account")(login)
    kopf.on.startup(registry=registry)(configure)
    kopf.on.startup(registry=registry)(manage_certificate)
    for on in (kopf.on.create, kopf.on.update, kopf.on.resume):
        on(**kvcaches, id="reconcile")(reconcile_kvcache)
    # optional: no finalizer; the KVCache never waits on the operator to go away.
    kopf.on.delete(**kvcaches, id="forget", optional=True)(forget_kvcache)
    kopf.timer(
        **kvcaches, id="recheck", interval=RECHECK_INTERVAL_S, initial_delay=RECHECK_INTERVAL_S
    )(recheck_kvcache)
    if not webhook:
        return
    kopf.on.mutate(
        "",
        "v1",
        "pods",
        id=WEBHOOK_ID,
        operations=["CREATE"],
        ignore_failures=True,
        side_effects=False,
        annotations={S.CACHE_ANNOTATION: kopf.PRESENT},
        registry=registry,
    )(inject_sidecar)
