"""Sidecar faults as the connector sees them: killed, restarted, vanished or
slow clients. Everything here runs real processes over real ZeroMQ sockets."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from typing import Any

import pytest
import zmq

from kvstrata.sidecar import protocol as p

NBYTES = 4096
TIMEOUT_S = 0.3
# How a call to a sidecar that is gone may end: its deadline passed, nothing
# listened, its session's liveness connection closed (the process ended), or
# it fell in the back-off window (answered without I/O). A call that blocked
# on a dead socket would never return (pytest-timeout ends the test); one
# that retried blindly would count one of these per attempt.
MISS_KINDS = {"timeout", "unavailable", "backoff", "sidecar_gone"}


def _all_calls(client: Any, keys: list[bytes]) -> dict[str, Any]:
    return {
        "lookup": lambda: client.lookup(keys, prefetch=True, owner="r"),
        "prepare_store": lambda: client.prepare_store(keys, NBYTES, "uint8", (NBYTES,), "r"),
        "commit_store": lambda: client.commit_store([1], [True]),
        "prepare_retrieve": lambda: client.prepare_retrieve(keys, "r"),
        "release": lambda: client.release([1]),
        "end_request": lambda: client.end_request("r"),
        "ping": client.ping,
        "stats": client.stats,
    }


@pytest.mark.timeout(120)
def test_every_call_fails_within_its_deadline_while_the_sidecar_is_killed(
    sidecar_factory: Any, kit: Any
):
    sidecar = sidecar_factory().start()
    client = sidecar.client(call_timeout_s=TIMEOUT_S)
    keys = kit.make_keys(4, seed=10)
    kit.store(client, keys, NBYTES, owner="w")
    epoch = client.epoch

    sidecar.kill()
    for _ in range(3):
        for name, call in _all_calls(client, keys).items():
            before = dict(client.errors)
            result = call()
            assert result in (None, False), name
            grew = {k: n - before.get(k, 0) for k, n in client.errors.items()}
            grew = {k: n for k, n in grew.items() if n}
            # Answered through its deadline or the back-off, at most one
            # network attempt (an unreachable peer counts twice: send, call).
            assert grew and set(grew) <= MISS_KINDS, (name, grew)
            assert grew.get("timeout", 0) <= 1 and grew.get("unavailable", 0) <= 2, (name, grew)
    assert not client.available()
    assert client.arena is None
    assert sum(client.errors.values()) >= 24

    sidecar.start()
    kit.wait_until(client.ping, 10, "client reconnects after the restart")
    assert client.epoch > epoch
    assert client.available()
    assert client.lookup(keys, prefetch=False, owner="r") is not None
    client.close()


def test_calls_in_flight_when_the_sidecar_dies_return_in_time_and_recover(
    sidecar_factory: Any, kit: Any
):
    sidecar = sidecar_factory().start()
    client = sidecar.client(call_timeout_s=TIMEOUT_S)
    keys = kit.make_keys(2, seed=11)
    # One entry per round of three calls: whether all succeeded. Rounds keep
    # coming while the sidecar is dead: no call in flight hangs.
    outcomes: list[bool] = []
    failures: list[BaseException] = []
    stop = threading.Event()

    def traffic() -> None:
        i = 0
        while not stop.is_set():
            i += 1
            fresh = kit.make_keys(1, seed=1000 + i)
            try:
                slots = client.prepare_store(fresh, NBYTES, "uint8", (NBYTES,), "w")
                ids = [s.lease_id for s in slots or [] if s is not None]
                client.commit_store(ids, [False] * len(ids))
                found = client.lookup(keys, prefetch=False, owner="w")
            except BaseException as exc:  # the test asserts there are none
                failures.append(exc)
                return
            outcomes.append(slots is not None and found is not None)

    thread = threading.Thread(target=traffic)
    thread.start()
    try:
        kit.wait_until(lambda: sum(outcomes) >= 5, 10, "traffic flowing")
        sidecar.kill()
        killed_at = len(outcomes)
        kit.wait_until(lambda: len(outcomes) >= killed_at + 10, 10, "calls after the kill")
        assert not any(outcomes[killed_at + 1 :])
        sidecar.start()
        restarted_at = len(outcomes)
        kit.wait_until(lambda: any(outcomes[restarted_at:]), 10, "traffic after restart")
    finally:
        stop.set()
        thread.join(10)
    assert failures == []
    # The calls cut off by the kill ended through their deadline, the end of
    # the liveness connection or the back-off, never an exception or another error.
    assert set(client.errors) <= MISS_KINDS | {p.E_NO_SESSION}, client.errors
    assert sum(client.errors.get(k, 0) for k in ("timeout", "unavailable", "sidecar_gone")) >= 1
    client.close()


_HOLDER = textwrap.dedent(
    """
    import sys, time
    from kvstrata.connector.client import SidecarClient
    from kvstrata.sidecar.keys import Namespace
    endpoint, client_id, *hex_keys = sys.argv[1:]
    ns = Namespace(model="kvstrata-test-model", block_size=16, chunk_size=16)
    client = SidecarClient(endpoint, ns, role="worker", client_id=client_id, call_timeout_s=2)
    slots = client.prepare_retrieve([bytes.fromhex(k) for k in hex_keys], "held")
    print(sum(s is not None for s in slots or []), flush=True)
    time.sleep(600)
    """
)


def test_leases_of_a_client_that_vanishes_are_reclaimed(sidecar_factory: Any, kit: Any):
    sidecar = sidecar_factory(overrides={"server": {"client_timeout_seconds": 1.0}}).start()
    other = sidecar.client()
    keys = kit.make_keys(3, seed=12)
    kit.store(other, keys, NBYTES, owner="w")
    kit.wait_until(lambda: sidecar.status()["leases_active"] == 0, 5, "stores settled")

    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, sidecar.endpoint, "holder-1", *(k.hex() for k in keys)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "3"
        held = {c["client_id"]: c["leases"] for c in sidecar.status()["clients"]}
        assert held["holder-1"] == 3
        assert sidecar.status()["leases_active"] >= 3
    finally:
        holder.kill()
        holder.wait()

    def reclaimed() -> bool:
        status = sidecar.status()
        ids = {c["client_id"] for c in status["clients"]}
        return "holder-1" not in ids and status["leases_active"] == 0

    kit.wait_until(reclaimed, 10, "the vanished client's leases reclaimed")
    # The other client is unaffected (its own session may have been reaped
    # as idle meanwhile; it says HELLO again by itself).
    assert kit.retrieve(other, keys, owner="r") == [kit.payload(k, NBYTES) for k in keys]
    other.close()


def test_a_killed_client_loses_its_leases_at_once_not_after_the_idle_timeout(
    sidecar_factory: Any, kit: Any
):
    # The idle timeout is a minute; the liveness socket reports the death at once.
    sidecar = sidecar_factory(overrides={"server": {"client_timeout_seconds": 60.0}}).start()
    other = sidecar.client()
    keys = kit.make_keys(2, seed=13)
    kit.store(other, keys, NBYTES, owner="w")
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, sidecar.endpoint, "holder-2", *(k.hex() for k in keys)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "2"
        assert sidecar.status()["leases_active"] >= 2
    finally:
        holder.kill()
        holder.wait()
    kit.wait_until(
        lambda: (
            sidecar.status()["leases_active"] == 0
            and "holder-2" not in {c["client_id"] for c in sidecar.status()["clients"]}
        ),
        3,
        "the killed client's session ended",
    )
    other.close()


def test_a_client_that_holds_leases_and_stops_reading_does_not_stall_another(
    sidecar_factory: Any, kit: Any
):
    sidecar = sidecar_factory(overrides={"server": {"lease_seconds": 1.5}}).start()
    busy = sidecar.client()
    keys = kit.make_keys(4, seed=13)
    kit.store(busy, keys, NBYTES, owner="w")

    # A raw client that says HELLO, then floods lease-taking requests and
    # never reads a reply nor releases anything.
    ctx = zmq.Context()
    rogue = ctx.socket(zmq.DEALER)
    rogue.setsockopt(zmq.LINGER, 0)
    rogue.connect(sidecar.endpoint)
    hello = p.HelloRequest(
        client_id="rogue", role="worker", fingerprint=kit.NAMESPACE.fingerprint(), pid=0
    )
    rogue.send(p.encode_request(p.HELLO, 1, "", hello))
    assert rogue.poll(5000)
    session = p.decode_reply(rogue.recv_multipart(), p.HELLO).body.session_id
    flood = p.encode_request(p.PREPARE_RETRIEVE, 2, session, p.PrepareRetrieveRequest(keys, "x"))
    for _ in range(500):
        rogue.send(flood, zmq.NOBLOCK)

    try:
        for i in range(40):
            fresh = kit.make_keys(1, seed=2000 + i)
            assert kit.store(busy, fresh, NBYTES, owner="w") == 1
            assert kit.retrieve(busy, fresh, owner="r") == [kit.payload(fresh[0], NBYTES)]
        # Every call answered within its deadline while the rogue's requests
        # queue: a stalled sidecar would have cost timeouts and back-offs.
        assert busy.errors == {}

        assert sidecar.status()["leases_active"] > 0  # the rogue still holds its leases
        # ... until they expire after lease_seconds.
        kit.wait_until(
            lambda: sidecar.status()["leases_active"] == 0, 10, "the rogue's leases expire"
        )
    finally:
        rogue.close(0)
        ctx.term()
    busy.close()


def test_a_late_reply_to_an_abandoned_request_is_discarded(sidecar: Any, kit: Any):
    import os
    import signal

    backoff_clock = [0.0]  # the back-off window ends when the test moves this
    client = sidecar.client(call_timeout_s=TIMEOUT_S, backoff_clock=lambda: backoff_clock[0])
    stored, absent = kit.make_keys(3, seed=14), kit.make_keys(3, seed=15)
    kit.store(client, stored, NBYTES, owner="w")

    os.kill(sidecar.proc.pid, signal.SIGSTOP)  # a sidecar that hangs, then wakes up
    try:
        assert client.lookup(stored, prefetch=False, owner="r") is None
        assert client.errors == {"timeout": 1}  # ended by its deadline
    finally:
        os.kill(sidecar.proc.pid, signal.SIGCONT)

    # Inside the back-off window that timeout opened, calls answer at once
    # (counted as back-off: no request reaches the sidecar).
    assert client.lookup(absent, prefetch=False, owner="r") is None
    assert client.errors == {"timeout": 1, "backoff": 1}
    backoff_clock[0] += 3600  # past the window

    # After it, the reply to the abandoned lookup (3 hits) arrives first; the
    # answer to this lookup must be its own (no hits).
    reply = kit.wait_until(
        lambda: client.lookup(absent, prefetch=False, owner="r"), 10, "an answer after it"
    )
    assert reply.hit_chunks == 0
    assert client.errors.get("late_reply") == 1
    client.close()
