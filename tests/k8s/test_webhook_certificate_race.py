"""Two operator replicas writing the webhook certificate at once, on the real API server.

The cluster-free suite decides the race against a model of the API server's
write rules (tests/operator/test_webhook_tls.py); here the real API server
refuses the loser's write (create of an existing Secret, patch at a stale
resourceVersion), and both replicas end up serving the certificate stored.
"""

from __future__ import annotations

import base64
import uuid
from pathlib import Path

import pytest

from kvstrata.operator.kube import WriteConflict
from kvstrata.operator.webhook_tls import WebhookTLSOptions, ensure_serving_tls

pytestmark = [pytest.mark.k8s]


class RivalFirst:
    """The real cluster, except that a rival replica's whole startup runs just
    before this replica's first write of the Secret reaches the API server."""

    def __init__(self, kube, rival) -> None:
        self.kube, self.rival, self.raced = kube, rival, False

    def __getattr__(self, name):
        return getattr(self.kube, name)

    def _race_first(self) -> None:
        if not self.raced:
            self.raced = True
            self.rival()

    def apply(self, obj):  # how a replica wrote the Secret before: the last write won
        self._race_first()
        return self.kube.apply(obj)

    def create(self, obj):
        self._race_first()
        return self.kube.create(obj)

    def replace(self, obj):
        self._race_first()
        return self.kube.replace(obj)


def options(namespace: str, secret: str, cert_dir: Path) -> WebhookTLSOptions:
    return WebhookTLSOptions(
        namespace=namespace,
        secret_name=secret,
        service_name="kvstrata-webhook",
        webhook_config=f"absent-{secret}",  # the caBundle is test_webhook_tls's concern
        cert_dir=cert_dir,
    )


def stored_certificate(kube, namespace: str, secret: str) -> bytes:
    found = kube.get("v1", "Secret", namespace, secret)
    return base64.b64decode(found["data"]["tls.crt"])


def test_the_api_server_refuses_a_second_create_and_a_stale_patch(kube, namespace):
    name = f"race-{uuid.uuid4().hex[:8]}"
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "namespace": namespace},
        "data": {"k": base64.b64encode(b"first").decode()},
    }
    created = kube.create(secret)
    with pytest.raises(WriteConflict):
        kube.create(secret)
    stale = {**secret["metadata"], "resourceVersion": created["metadata"]["resourceVersion"]}
    second = {"k": base64.b64encode(b"second").decode()}
    kube.replace({**secret, "metadata": stale, "data": second})  # the version read: accepted
    third = {"k": base64.b64encode(b"third").decode()}
    with pytest.raises(WriteConflict):  # another writer changed it since: refused
        kube.replace({**secret, "metadata": stale, "data": third})
    assert kube.get("v1", "Secret", namespace, name)["data"] == second


@pytest.mark.parametrize("stored_first", [False, True], ids=["create", "renewal"])
def test_two_replicas_writing_at_once_serve_the_certificate_stored(
    kube, namespace, tmp_path, stored_first
):
    name = f"webhook-tls-{uuid.uuid4().hex[:8]}"
    if stored_first:  # a certificate for other names: both replicas renew it
        kube.create(
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {"name": name, "namespace": namespace},
                "data": {"tls.crt": base64.b64encode(b"not a certificate").decode()},
            }
        )
    rival = options(namespace, name, tmp_path / "rival")
    mine = options(namespace, name, tmp_path / "mine")
    rival_outcome: list[str] = []
    racing = RivalFirst(kube, lambda: rival_outcome.append(ensure_serving_tls(kube, rival)))
    outcome = ensure_serving_tls(racing, mine)
    stored = stored_certificate(kube, namespace, name)
    assert (tmp_path / "rival" / "tls.crt").read_bytes() == stored
    assert (tmp_path / "mine" / "tls.crt").read_bytes() == stored
    assert outcome == "taken from another replica"
    assert rival_outcome and rival_outcome[0] != "taken from another replica"
