"""The connector's retry gate in front of a sidecar that does not answer."""

from __future__ import annotations

import time

from kvstrata.connector.client import SidecarClient
from kvstrata.connector.gate import MAX_FACTOR, RetryGate
from kvstrata.sidecar.keys import Namespace


def absent_client(tmp_path) -> SidecarClient:
    return SidecarClient(f"ipc://{tmp_path}/nobody.sock", Namespace(model="m"), role="worker")


def test_while_the_sidecar_is_down_only_one_probe_per_interval_goes_through(tmp_path) -> None:
    client = absent_client(tmp_path)
    gate = RetryGate(client, interval_s=0.05)
    assert gate.allow()  # the first probe
    assert not gate.allow() and not gate.allow()
    deadline = time.monotonic() + 2
    while not gate.allow():
        assert time.monotonic() < deadline, "the next probe never came"
    client.close()


def test_failed_probes_double_the_interval_up_to_its_cap(tmp_path) -> None:
    client = absent_client(tmp_path)
    gate = RetryGate(client, interval_s=0.01)
    intervals = []
    for _ in range(6):
        gate._next_probe = min(gate._next_probe, time.monotonic())  # make the probe due
        assert gate.allow()
        intervals.append(round(gate._interval_s, 3))
    assert intervals == [0.01, 0.02, 0.04, 0.08, 0.08, 0.08]
    assert max(intervals) == 0.01 * MAX_FACTOR
    client.close()
