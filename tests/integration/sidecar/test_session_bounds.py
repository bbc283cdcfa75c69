"""One client cannot grow the session table (and ``/status``) without end.

A real sidecar; raw ZeroMQ peers say HELLO in a loop, each with a new
client id so that no HELLO replaces an earlier session. Past
``server.max_sessions_per_peer`` on one connection, and past
``server.max_sessions_per_uid`` over several connections of this test's own
uid, a HELLO is refused with ``busy`` and the refusal is counted; the
sessions already open keep working.
"""

from __future__ import annotations

from typing import Any

from kvstrata.sidecar import protocol as p
from kvstrata.testing.rawpeer import RawPeer

PER_PEER = 16  # server.max_sessions_per_peer's default
PER_UID = 10
HELLOS = 50  # bounded: well past either bound


def _hello(peer: RawPeer, fingerprint: bytes, n: int) -> list[Any]:
    body = {"client_id": f"flood-{n}", "role": "worker", "fingerprint": fingerprint,
            "transfer_mode": "host", "pid": 4242}  # fmt: skip
    return peer.call(p.HELLO, body, request_id=n, session_id="")


def _refusals(sidecar: Any, bound: str) -> float:
    prefix = f'kvstrata_client_bound_refusals_total{{bound="{bound}"}} '
    for line in sidecar.get("/metrics").splitlines():
        if line.startswith(prefix):
            return float(line[len(prefix) :])
    raise AssertionError(f"/metrics has no {prefix.strip()}")


def test_hellos_past_the_bound_of_one_connection_are_refused_and_counted(
    sidecar_factory: Any, kit: Any
):
    sidecar = sidecar_factory(overrides={"server": {"status_detail": True}}).start()
    fingerprint = kit.NAMESPACE.fingerprint()
    peer = RawPeer(sidecar.endpoint)
    try:
        replies = [_hello(peer, fingerprint, n) for n in range(HELLOS)]
        accepted = [r for r in replies if r[2]]
        refused = [r[3] for r in replies if not r[2]]
        assert len(accepted) == PER_PEER
        assert len(refused) == HELLOS - PER_PEER
        assert {r["code"] for r in refused} == {p.E_BUSY}
        assert "server.max_sessions_per_peer" in refused[0]["message"]
        assert _refusals(sidecar, "sessions_per_peer") == HELLOS - PER_PEER
        status = sidecar.status()
        assert status["clients_connected"] == PER_PEER
        assert len(status["clients"]) == PER_PEER

        # A session opened before the refusals still serves its client.
        peer.session_id = str(accepted[0][3]["session_id"])
        lookup = {"keys": kit.make_keys(2, seed=38), "owner": "r", "prefetch": False}
        reply = peer.call(p.LOOKUP, lookup)
        assert reply[2], reply
        assert reply[3]["hit_chunks"] == 0
    finally:
        peer.close()


def test_hellos_past_the_bound_of_one_uid_are_refused_over_any_number_of_connections(
    sidecar_factory: Any, kit: Any
):
    sidecar = sidecar_factory(
        overrides={"server": {"max_sessions_per_peer": 2, "max_sessions_per_uid": PER_UID}}
    ).start()
    fingerprint = kit.NAMESPACE.fingerprint()
    peers = [RawPeer(sidecar.endpoint) for _ in range(HELLOS // 2)]
    try:
        # Two HELLOs per connection: every connection stays within its own bound.
        replies = [_hello(peer, fingerprint, 2 * i + j) for i, peer in enumerate(peers)
                   for j in range(2)]  # fmt: skip
        accepted = sum(1 for r in replies if r[2])
        refused = [r[3] for r in replies if not r[2]]
        assert accepted == PER_UID
        assert {r["code"] for r in refused} == {p.E_BUSY}
        assert "server.max_sessions_per_uid" in refused[0]["message"]
        assert _refusals(sidecar, "sessions_per_uid") == len(refused) == HELLOS - PER_UID
        assert _refusals(sidecar, "sessions_per_peer") == 0
        assert sidecar.status()["clients_connected"] == PER_UID
    finally:
        for peer in peers:
            peer.close()
