"""A client whose sidecar has never started answers at once, not at its deadline.

"At once" is read from the client's counters: a call that found nothing
listening counts ``unavailable`` (no wait), one that waited out its deadline
counts ``timeout``. pytest-timeout bounds the test should a call hang."""

from __future__ import annotations

import pytest

from kvstrata.connector.client import SidecarClient
from kvstrata.sidecar.keys import Namespace


@pytest.mark.timeout(60)
def test_calls_to_a_never_started_ipc_sidecar_miss_without_waiting_for_the_deadline(tmp_path):
    client = SidecarClient(
        f"ipc://{tmp_path}/absent.sock",
        Namespace(model="m"),
        role="scheduler",
        call_timeout_s=2.0,
        backoff_clock=lambda: 0.0,  # stays inside the first back-off window
    )
    try:
        assert client.ping() is False
        assert client.lookup([b"\0" * 48], prefetch=True, owner="r") is None
        assert client.available() is False
        # The probe saw nobody listening and did not wait; the lookup inside
        # the back-off window did not touch the network at all.
        assert client.errors == {"unavailable": 2, "backoff": 1}
    finally:
        client.close()
