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
from dataclasses import dataclass
from pathlib import Path

from kvstrata.operator import certs
from kvstrata.operator.reconcile import Cluster

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


def ensure_serving_tls(cluster: Cluster, opts: WebhookTLSOptions) -> str:
    """Make the Secret, the files and the caBundle agree on a valid certificate.

    Returns what was done (for the log): ``"kept"`` or the rotation reason.
    """
    names = certs.service_dns_names(opts.service_name, opts.namespace)
    secret = cluster.get("v1", "Secret", opts.namespace, opts.secret_name)
    bundle = _decode(secret)
    why = certs.needs_rotation(bundle, names)
    if why is not None or bundle is None:
        bundle = certs.issue(names, ca=bundle)
        cluster.apply(
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {"name": opts.secret_name, "namespace": opts.namespace},
                "type": "Opaque",
                "data": {
                    k: base64.b64encode(v).decode() for k, v in bundle.as_secret_data().items()
                },
            }
        )
        logger.info("webhook certificate issued: %s", why)
    write_files(bundle, opts.cert_dir)
    patch_ca_bundle(cluster, opts.webhook_config, bundle.ca_crt)
    return why or "kept"


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
