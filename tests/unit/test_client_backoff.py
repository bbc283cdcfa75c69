"""The client's one retry policy: back off after a call the sidecar did not
answer, answer at once inside the window, double the window up to its cap."""

from __future__ import annotations

import itertools
import time

import zmq

from kvstrata.connector.client import SidecarClient
from kvstrata.sidecar.keys import Namespace
from kvstrata.testing.poll import wait_until


def _client(endpoint: str, **kwargs) -> SidecarClient:
    kwargs.setdefault("call_timeout_s", 0.3)
    return SidecarClient(endpoint, Namespace(model="m"), role="worker", **kwargs)


def test_calls_inside_the_back_off_window_answer_at_once_without_a_probe(tmp_path) -> None:
    client = _client(f"ipc://{tmp_path}/absent.sock", backoff_s=5.0, backoff_max_s=5.0)
    try:
        assert client.ping() is False  # the probe: nobody listens
        probed = dict(client.errors)
        assert probed.get("unavailable") and "backoff" not in probed
        started = time.monotonic()
        for _ in range(20):
            assert client.lookup([b"\0" * 48], prefetch=True, owner="r") is None
        assert time.monotonic() - started < 0.5
        assert client.errors == {**probed, "backoff": 20}
    finally:
        client.close()


def test_probes_of_an_absent_sidecar_come_at_doubling_intervals_up_to_the_cap(tmp_path) -> None:
    client = _client(f"ipc://{tmp_path}/absent.sock", backoff_s=0.02, backoff_max_s=0.08)
    probes: list[float] = []

    def probed_six_times() -> bool:
        before = client.errors.get("unavailable", 0)
        client.ping()
        if client.errors.get("unavailable", 0) > before:
            probes.append(time.monotonic())
        return len(probes) >= 6

    try:
        wait_until(probed_six_times, 10, "six probes", step=0.002)
    finally:
        client.close()
    gaps = [b - a for a, b in itertools.pairwise(probes)]
    for gap, window in zip(gaps, [0.02, 0.04, 0.08, 0.08, 0.08], strict=True):
        assert gap >= window, gaps
    assert max(gaps) < 0.08 + 1.0, gaps  # capped, with slack for a busy machine


def test_a_call_that_times_out_backs_off_and_sends_nothing_inside_the_window(tmp_path) -> None:
    """A peer that takes requests and never answers (a stalled sidecar)."""
    endpoint = f"ipc://{tmp_path}/silent.sock"
    ctx = zmq.Context.instance()
    silent = ctx.socket(zmq.ROUTER)
    silent.setsockopt(zmq.LINGER, 0)
    silent.bind(endpoint)
    client = _client(endpoint, call_timeout_s=0.2, backoff_s=5.0, backoff_max_s=5.0)
    try:
        started = time.monotonic()
        assert client.ping() is False
        assert time.monotonic() - started >= 0.15  # waited out its deadline once
        assert client.errors == {"timeout": 1}
        assert silent.poll(1000, zmq.POLLIN)
        silent.recv_multipart()  # the HELLO
        started = time.monotonic()
        assert client.stats() is None and client.ping() is False
        assert time.monotonic() - started < 0.1
        assert client.errors == {"timeout": 1, "backoff": 2}
        assert not silent.poll(100, zmq.POLLIN), "a call inside the window reached the peer"
    finally:
        client.close()
        silent.close(0)
