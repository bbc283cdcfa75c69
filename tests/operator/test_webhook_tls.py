"""Webhook certificates: issue, rotate, store, serve over real TLS, patch caBundle."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import datetime as dt
import json
import socket
import ssl

import pytest
from cryptography import x509

from kvstrata.operator import certs
from kvstrata.operator.handlers import NamespacedWebhookServer
from kvstrata.operator.webhook_tls import WebhookTLSOptions, ensure_serving_tls, patch_ca_bundle

NAMES = certs.service_dns_names("kvstrata-webhook", "kvstrata-system")
SVC = "kvstrata-webhook.kvstrata-system.svc"


def webhook_config(name="kvstrata-webhook", webhooks=2):
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": name},
        "webhooks": [
            {
                "name": f"w{i}.kvstrata.io",
                "clientConfig": {"service": {"name": "s", "namespace": "n"}},
            }
            for i in range(webhooks)
        ],
    }


@pytest.fixture
def options(tmp_path):
    return WebhookTLSOptions(
        namespace="kvstrata-system",
        secret_name="kvstrata-webhook-tls",
        service_name="kvstrata-webhook",
        webhook_config="kvstrata-webhook",
        cert_dir=tmp_path / "certs",
    )


def test_an_issued_certificate_verifies_against_its_ca_for_the_service_names():
    bundle = certs.issue(NAMES)
    cert = x509.load_pem_x509_certificate(bundle.tls_crt)
    ca = x509.load_pem_x509_certificate(bundle.ca_crt)
    cert.verify_directly_issued_by(ca)
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == NAMES
    assert certs.needs_rotation(bundle, NAMES) is None


def test_ip_addresses_become_ip_subject_alternative_names():
    bundle = certs.issue(["127.0.0.1", "kvstrata.local"])
    cert = x509.load_pem_x509_certificate(bundle.tls_crt)
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    assert certs.needs_rotation(bundle, ["kvstrata.local", "127.0.0.1"]) is None


def test_rotation_is_asked_for_a_missing_foreign_or_renamed_certificate():
    bundle = certs.issue(NAMES)
    assert certs.needs_rotation(None, NAMES) == "no certificate stored"
    assert certs.needs_rotation(bundle, ["other.svc"]) == "serving certificate names other hosts"
    foreign = certs.issue(NAMES)
    mixed = certs.TLSBundle(bundle.ca_crt, bundle.ca_key, foreign.tls_crt, foreign.tls_key)
    assert "not issued by the stored CA" in certs.needs_rotation(mixed, NAMES)
    garbage = certs.TLSBundle(b"junk", b"junk", b"junk", b"junk")
    assert certs.needs_rotation(garbage, NAMES) == "stored certificate is not readable PEM"


def test_a_serving_certificate_near_expiry_is_reissued_by_the_same_ca(monkeypatch):
    bundle = certs.issue(NAMES)
    later = dt.datetime.now(dt.timezone.utc) + certs.SERVING_LIFETIME - dt.timedelta(days=10)
    monkeypatch.setattr(certs, "_now", lambda: later)
    assert certs.needs_rotation(bundle, NAMES) == "serving certificate expires within 30 days"
    renewed = certs.issue(NAMES, ca=bundle)
    assert renewed.ca_crt == bundle.ca_crt  # caBundle stays put
    assert renewed.tls_crt != bundle.tls_crt


def test_ensure_stores_writes_and_patches_then_keeps_everything(cluster, options):
    cluster.put(webhook_config())
    assert ensure_serving_tls(cluster, options) == "no certificate stored"
    secret = cluster.get("v1", "Secret", "kvstrata-system", "kvstrata-webhook-tls")
    ca = base64.b64decode(secret["data"]["ca.crt"])
    crt = (options.cert_dir / "tls.crt").read_bytes()
    assert crt == base64.b64decode(secret["data"]["tls.crt"])
    config = cluster.get(
        "admissionregistration.k8s.io/v1", "MutatingWebhookConfiguration", "", "kvstrata-webhook"
    )
    assert {w["clientConfig"]["caBundle"] for w in config["webhooks"]} == {
        base64.b64encode(ca).decode()
    }
    patched = len(cluster.patches)
    assert ensure_serving_tls(cluster, options) == "kept"
    assert (options.cert_dir / "tls.crt").read_bytes() == crt
    assert len(cluster.patches) == patched


def test_a_missing_webhook_configuration_is_reported_not_raised(cluster):
    assert patch_ca_bundle(cluster, "absent", b"pem") is False


def _post_over_tls(port: int, ca_pem: bytes, body: bytes) -> dict:
    context = ssl.create_default_context(cadata=ca_pem.decode())
    raw = socket.create_connection(("127.0.0.1", port), timeout=5)
    with raw, context.wrap_socket(raw, server_hostname=SVC) as tls:
        head = (
            f"POST /inject HTTP/1.1\r\nHost: {SVC}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        )
        tls.sendall(head.encode() + body)
        data = b""
        while chunk := tls.recv(65536):
            data += chunk
    return json.loads(data.split(b"\r\n\r\n", 1)[1])


def test_the_webhook_server_serves_the_issued_certificate_and_fills_the_namespace(tmp_path):
    bundle = certs.issue(NAMES)
    (tmp_path / "tls.crt").write_bytes(bundle.tls_crt)
    (tmp_path / "tls.key").write_bytes(bundle.tls_key)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = NamespacedWebhookServer(
        addr="127.0.0.1", port=port, certfile=tmp_path / "tls.crt", pkeyfile=tmp_path / "tls.key"
    )
    seen = []

    async def handle(request, **_):
        seen.append(request["request"]["object"]["metadata"])
        return {"response": {"uid": request["request"]["uid"], "allowed": True}}

    review = {"request": {"uid": "u1", "namespace": "ml", "object": {"metadata": {"name": "p"}}}}

    async def scenario():
        serving = server(handle)
        await serving.__anext__()  # the server listens once it yields its client config
        try:
            return await asyncio.to_thread(
                _post_over_tls, port, bundle.ca_crt, json.dumps(review).encode()
            )
        finally:
            await serving.aclose()

    answer = asyncio.run(asyncio.wait_for(scenario(), 20))
    assert answer == {"response": {"uid": "u1", "allowed": True}}
    assert seen == [{"name": "p", "namespace": "ml"}]


class RacingSecretWrites:
    """Two replicas' view of one API server (the in-memory model of its write rules).

    The first time ``replica`` writes the webhook Secret, ``rival`` runs its
    whole startup before that write reaches the store: both read "no Secret",
    both issued a certificate, the rival's write lands first.
    """

    def __init__(self, store, rival):
        self.store, self.rival, self.raced = store, rival, False

    def __getattr__(self, name):
        return getattr(self.store, name)

    def _race_first(self, obj):
        if obj["kind"] == "Secret" and not self.raced:
            self.raced = True
            self.rival()

    def apply(self, obj):
        self._race_first(obj)
        return self.store.apply(obj)

    def create(self, obj):
        self._race_first(obj)
        return self.store.create(obj)

    def replace(self, obj):
        self._race_first(obj)
        return self.store.replace(obj)


def _race_two_replicas(cluster, options, tmp_path) -> tuple[str, list[str]]:
    """Two replicas run ensure_serving_tls at once (the rival's write lands
    between this replica's read and its write); both must end up serving the
    certificate the Secret holds, and the webhook trusts that Secret's CA.
    Returns this replica's outcome and the rival's."""
    other = dataclasses.replace(options, cert_dir=tmp_path / "other-certs")
    rival_done = []
    racing = RacingSecretWrites(
        cluster, lambda: rival_done.append(ensure_serving_tls(cluster, other))
    )
    outcome = ensure_serving_tls(racing, options)
    secret = cluster.get("v1", "Secret", "kvstrata-system", "kvstrata-webhook-tls")
    stored = base64.b64decode(secret["data"]["tls.crt"])
    assert (options.cert_dir / "tls.crt").read_bytes() == stored
    assert (other.cert_dir / "tls.crt").read_bytes() == stored
    config = cluster.get(
        "admissionregistration.k8s.io/v1", "MutatingWebhookConfiguration", "", "kvstrata-webhook"
    )
    ca = secret["data"]["ca.crt"]
    assert {w["clientConfig"]["caBundle"] for w in config["webhooks"]} == {ca}
    return outcome, rival_done


def test_two_replicas_starting_together_serve_the_one_certificate_in_the_secret(
    cluster, options, tmp_path
):
    cluster.put(webhook_config())
    outcome, rival_done = _race_two_replicas(cluster, options, tmp_path)
    assert rival_done == ["no certificate stored"]  # the rival won the create
    assert outcome == "taken from another replica"


def test_two_replicas_rotating_together_serve_the_one_certificate_in_the_secret(
    cluster, options, tmp_path
):
    cluster.put(webhook_config())
    renamed = certs.issue(["old-name.svc"])  # names other hosts: both replicas rotate it
    cluster.put(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "kvstrata-webhook-tls", "namespace": "kvstrata-system"},
            "data": {k: base64.b64encode(v).decode() for k, v in renamed.as_secret_data().items()},
        }
    )
    outcome, rival_done = _race_two_replicas(cluster, options, tmp_path)
    assert rival_done == ["serving certificate names other hosts"]
    assert outcome == "taken from another replica"
