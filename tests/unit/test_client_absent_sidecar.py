"""A client whose sidecar has never started answers at once, not at its deadline."""

from __future__ import annotations

import time

from kvstrata.connector.client import SidecarClient
from kvstrata.sidecar.keys import Namespace


def test_calls_to_a_never_started_ipc_sidecar_miss_well_before_the_deadline(tmp_path):
    client = SidecarClient(
        f"ipc://{tmp_path}/absent.sock",
        Namespace(model="m"),
        role="scheduler",
        call_timeout_s=2.0,
    )
    try:
        started = time.monotonic()
        assert client.ping() is False
        assert client.lookup([b"\0" * 48], prefetch=True, owner="r") is None
        elapsed = time.monotonic() - started
        assert elapsed < 1.0, f"two calls took {elapsed:.2f}s against a 2s deadline"
        assert client.available() is False
        assert sum(client.errors.values()) >= 2
    finally:
        client.close()
