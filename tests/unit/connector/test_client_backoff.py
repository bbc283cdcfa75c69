"""The client's one retry policy: back off after a call the sidecar did not
answer, answer at once inside the window, double the window up to its cap.

The back-off window is read from a clock the test sets (``backoff_clock``),
so the windows are stepped through, not timed; call deadlines stay real."""

from __future__ import annotations

import itertools

import pytest
import zmq

from kvstrata.connector.client import SidecarClient
from kvstrata.sidecar.keys import Namespace


class SetClock:
    """A clock that reads what the test set it to (whole milliseconds)."""

    def __init__(self) -> None:
        self.ms = 1_000_000

    def __call__(self) -> float:
        return self.ms / 1000


def _client(endpoint: str, clock: SetClock, **kwargs) -> SidecarClient:
    kwargs.setdefault("call_timeout_s", 0.3)
    return SidecarClient(
        endpoint, Namespace(model="m"), role="worker", backoff_clock=clock, **kwargs
    )


def test_calls_inside_the_back_off_window_answer_at_once_without_a_probe(tmp_path) -> None:
    clock = SetClock()
    client = _client(f"ipc://{tmp_path}/absent.sock", clock, backoff_s=5.0, backoff_max_s=5.0)
    try:
        assert client.ping() is False  # the probe: nobody listens
        probed = dict(client.errors)
        assert probed.get("unavailable") and "backoff" not in probed
        clock.ms += 4_999  # the last millisecond of the window
        for _ in range(20):
            assert client.lookup([b"\0" * 48], prefetch=True, owner="r") is None
        # Answered from the window: counted as back-off, none reached the network.
        assert client.errors == {**probed, "backoff": 20}
        clock.ms += 1  # the window is over: the next call probes again
        assert client.ping() is False
        assert client.errors["unavailable"] > probed["unavailable"]
    finally:
        client.close()


def test_probes_of_an_absent_sidecar_come_at_doubling_intervals_up_to_the_cap(tmp_path) -> None:
    clock = SetClock()
    client = _client(f"ipc://{tmp_path}/absent.sock", clock, backoff_s=0.02, backoff_max_s=0.08)
    probes: list[int] = []  # the clock (ms) at each call that reached the network
    try:
        while len(probes) < 6:
            before = client.errors.get("unavailable", 0)
            client.ping()
            if client.errors.get("unavailable", 0) > before:
                probes.append(clock.ms)
            clock.ms += 1
    finally:
        client.close()
    windows = [b - a for a, b in itertools.pairwise(probes)]
    # Doubling from backoff_s, capped at backoff_max_s (to the millisecond the
    # clock steps by: the window's end is a sum of floats).
    assert windows == pytest.approx([20, 40, 80, 80, 80], abs=1)


def test_a_call_that_times_out_backs_off_and_sends_nothing_inside_the_window(tmp_path) -> None:
    """A peer that takes requests and never answers (a stalled sidecar)."""
    endpoint = f"ipc://{tmp_path}/silent.sock"
    ctx = zmq.Context.instance()
    silent = ctx.socket(zmq.ROUTER)
    silent.setsockopt(zmq.LINGER, 0)
    silent.bind(endpoint)
    clock = SetClock()
    client = _client(endpoint, clock, call_timeout_s=0.2, backoff_s=5.0, backoff_max_s=5.0)
    try:
        assert client.ping() is False
        assert client.errors == {"timeout": 1}  # waited out its deadline once
        assert silent.poll(1000, zmq.POLLIN)
        silent.recv_multipart()  # the HELLO
        clock.ms += 4_999
        assert client.stats() is None and client.ping() is False
        assert client.errors == {"timeout": 1, "backoff": 2}
        assert not silent.poll(100, zmq.POLLIN), "a call inside the window reached the peer"
    finally:
        client.close()
        silent.close(0)
