"""Requests at the edges of the protocol, sent raw to a real sidecar over its
real ZeroMQ socket: wrong types named, and errors a client can match."""

from __future__ import annotations

from typing import Any

import pytest

from kvstrata.sidecar import protocol as p
from kvstrata.testing.rawpeer import RawPeer


@pytest.mark.parametrize("runs", [0, False, "", {}], ids=repr)
def test_runs_of_a_wrong_type_is_refused_naming_the_field(sidecar: Any, kit: Any, runs: Any):
    peer = RawPeer(sidecar.endpoint)
    peer.hello(kit.NAMESPACE.fingerprint())
    keys = [bytes(k) for k in kit.make_keys(2, seed=2602)]
    _, request_id, ok, body = peer.call(
        p.PREPARE_RETRIEVE, {"keys": keys, "owner": "r", "runs": runs}, request_id=41
    )
    # On 4edd4cb a falsy ``runs`` read as "no runs" and the request was served.
    assert (ok, request_id, body["code"]) == (False, 41, p.E_BAD_REQUEST)
    assert "'runs'" in body["message"]
    # The sidecar keeps serving the same peer.
    assert peer.call(p.PING, {}, request_id=42)[2] is True
    peer.close()


def test_a_frame_over_the_item_limit_is_answered_with_its_own_request_id(sidecar: Any, kit: Any):
    peer = RawPeer(sidecar.endpoint)
    peer.hello(kit.NAMESPACE.fingerprint())
    too_many = list(range(p.MAX_KEYS + 1))
    _, request_id, ok, body = peer.call(p.RELEASE, {"lease_ids": too_many}, request_id=4242)
    assert ok is False
    assert request_id == 4242  # on 4edd4cb: 0, which no client request carries
    assert body["code"] in (p.E_BAD_FRAME, p.E_BAD_REQUEST)
    assert str(p.MAX_KEYS) in body["message"]
    peer.close()
