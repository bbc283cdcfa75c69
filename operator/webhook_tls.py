"""Keep the webhook's serving certificate in its Secret, on disk, and in the caBundle.

Why: the certificate logic (:mod:`kvstrata.operator.certs`) is pure; this
module is where it meets the cluster, once at startup and then on a timer.
The Secret layout is documented in :mod:`kvstrata.operator.certs`. The files
written into ``cert_dir`` (``tls.crt``, ``tls.key``) are what kopf's webhook
server serves; it reloads them when they change, so a rotation needs no
restart.
"""

from __future__ import annotations

import base64
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from kvstrata.operator import certs
from kvstrata.operator.cluster import Cluster
from kvstrata.operator.kube import WriteConflict

logger = logging.getLogger(__name__)

ADMISSION_API = "admissionregistration.k8s.io/v1"


@dataclass(frozen=True, slots=True)
class WebhookTLSOptions:
    namespace: str  # where the operator and its Secret live
    secret_name: str  # Secret holding ca/tls PEMs
    service_name: str  # webhook Service: the certificate's DNS names
    webhook_config: str  # MutatingWebhookConfiguration to patch caBundle into
    cert_dir: Path  # where tls.crt / tls.key are written for the server


def _decode(secret: dict | None) -> certs.TLSBundle | None:
    data = (secret or {}).get("data") or {}
    try:
        return certs.TLSBundle.from_secret_data({k: base64.b64decode(v) for k, v in data.items()})
    except ValueError:
        return None


class TLSCluster(Cluster, Protocol):
    """The cluster calls the certificate needs beyond reconcile's: writes that never overwrite."""

    def create(self, obj: Mapping[str, Any]) -> dict: ...  # WriteConflict when it exists

    def replace(self, obj: Mapping[str, Any]) -> dict: ...  # WriteConflict when changed since read


# Replicas racing on one Secret settle within two rounds (one create, one
# rotation); more rounds than that means something keeps rewriting it.
_MAX_ROUNDS = 4


def _secret(opts: WebhookTLSOptions, bundle: certs.TLSBundle, read: dict | None) -> dict:
    metadata: dict[str, Any] = {"name": opts.secret_name, "namespace": opts.namespace}
    if read is not None:
        # The version read: the API server refuses the replace when another
        # replica wrote the Secret since, instead of one overwriting the other.
        metadata["resourceVersion"] = (read.get("metadata") or {}).get("resourceVersion")
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": metadata,
        "type": "Opaque",
        "data": {k: base64.b64encode(v).decode() for k, v in bundle.as_secret_data().items()},
    }


def ensure_serving_tls(cluster: TLSCluster, opts: WebhookTLSOptions) -> str:
    """Make the Secret, the files and the caBundle agree on a valid certificate.

    Several operator replicas run this at once. The Secret is the one truth
    they share: a replica writes its new certificate only with create (absent)
    or replace at the version it read (present), so the API server lets exactly
    one writer win; a loser (409) reads the winner's certificate and serves
    that one. Returns what was done (for the log): ``"kept"``, the rotation
    reason, or ``"taken from another replica"``.
    """
    names = certs.service_dns_names(opts.service_name, opts.namespace)
    outcome = "kept"
    for _ in range(_MAX_ROUNDS):
        secret = cluster.get("v1", "Secret", opts.namespace, opts.secret_name)
        bundle = _decode(secret)
        why = certs.needs_rotation(bundle, names)
        if why is None and bundle is not None:
            break
        issued = certs.issue(names, ca=bundle)
        try:
            if secret is None:
                cluster.create(_secret(opts, issued, None))
            else:
                cluster.replace(_secret(opts, issued, secret))
        except WriteConflict:
            logger.info("another replica wrote the webhook certificate first; serving theirs")
            outcome = "taken from another replica"
            continue
        logger.info("webhook certificate issued: %s", why)
        bundle, outcome = issued, why or "issued"
        break
    else:
        raise RuntimeError(
            f"Secret {opts.namespace}/{opts.secret_name} changed under every one of"
            f" {_MAX_ROUNDS} writes of the webhook certificate"
        )
    write_files(bundle, opts.cert_dir)
    patch_ca_bundle(cluster, opts.webhook_config, bundle.ca_crt)
    return outcome


def write_files(bundle: certs.TLSBundle, cert_dir: Path) -> None:
    """Write tls.crt/tls.key only when they differ (a change restarts the server)."""
    cert_dir.mkdir(parents=True, exist_ok=True)
    for name, data in (("tls.crt", bundle.tls_crt), ("tls.key", bundle.tls_key)):
        path = cert_dir / name
        if path.exists() and path.read_bytes() == data:
            continue
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(data)
        os.chmod(tmp, 0o600)
        tmp.replace(path)


def patch_ca_bundle(cluster: Cluster, config_name: str, ca_pem: bytes) -> bool:
    """Put the CA into every webhook of the configuration; False when it is absent."""
    config = cluster.get(ADMISSION_API, "MutatingWebhookConfiguration", "", config_name)
    if config is None:
        logger.warning("MutatingWebhookConfiguration %s not found; caBundle not set", config_name)
        return False
    encoded = base64.b64encode(ca_pem).decode()
    webhooks = config.get("webhooks") or []
    if all((w.get("clientConfig") or {}).get("caBundle") == encoded for w in webhooks):
        return True
    for webhook in webhooks:
        webhook.setdefault("clientConfig", {})["caBundle"] = encoded
    cluster.patch(
        ADMISSION_API, "MutatingWebhookConfiguration", "", config_name, {"webhooks": webhooks}
    )
    return True
