"""An ``ipc://@NAME`` endpoint (a Linux abstract socket, which has no file)
serves a real sidecar process and the connector's real client end to end."""

from __future__ import annotations

import uuid
from typing import Any

from kvstrata.connector.client import SidecarClient


def test_a_client_stores_and_retrieves_through_a_sidecar_on_an_abstract_socket(
    sidecar_factory: Any, kit: Any
):
    endpoint = f"ipc://@kvstrata-test-{uuid.uuid4().hex}"
    sidecar = sidecar_factory(overrides={"server": {"endpoint": endpoint}}).start()
    client = SidecarClient(endpoint, kit.NAMESPACE, role="worker", call_timeout_s=2.0)
    try:
        keys = kit.make_keys(3, seed=27)
        assert kit.store(client, keys, 4096, owner="w") == 3
        assert kit.retrieve(client, keys, owner="w") == [kit.payload(k, 4096) for k in keys]
        assert sidecar.status()["clients_connected"] == 1
    finally:
        client.close()


def test_a_client_of_an_abstract_socket_nothing_is_bound_to_counts_it_unavailable(kit: Any):
    """Not a timeout: the client sees that nothing is bound and does not send."""
    endpoint = f"ipc://@kvstrata-test-{uuid.uuid4().hex}"
    client = SidecarClient(endpoint, kit.NAMESPACE, role="worker", call_timeout_s=2.0)
    try:
        assert not client.ping()
        assert client.errors.get("unavailable", 0) >= 1, client.errors
        assert "timeout" not in client.errors, client.errors
    finally:
        client.close()
