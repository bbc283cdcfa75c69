"""A maximal frame costs the sidecar nothing until its sender is known: the
session is checked before any per-item work on the body. Raw peers over the
sidecar's real ZeroMQ socket, each its own connection."""

from __future__ import annotations

from typing import Any

import msgpack

from kvstrata.sidecar import protocol as p
from kvstrata.testing.rawpeer import RawPeer

PEERS = 6


def _maximal_load_blocks(fingerprint: bytes, session_id: str) -> bytes:
    """A LOAD_BLOCKS frame of about 3.7 MB whose very last block id is invalid:
    only a reader that checked every item before it would notice."""
    keys = [fingerprint + i.to_bytes(32, "big") for i in range(p.MAX_KEYS)]
    block_ids: list[list[Any]] = [[1000 + j for j in range(130)] for _ in keys]
    block_ids[-1][-1] = "not a block id"
    body = {"keys": keys, "block_ids": block_ids, "owner": "r"}
    frame = msgpack.packb([p.PROTOCOL_VERSION, 7, p.LOAD_BLOCKS, session_id, body])
    assert 3 << 20 < len(frame) <= p.MAX_MESSAGE_BYTES
    return frame


def _errors(sidecar: Any, kind: str) -> float:
    for line in sidecar.get("/metrics").splitlines():
        if line.startswith("kvstrata_errors_total{") and f'kind="{kind}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_large_frames_without_a_session_are_refused_before_their_body_is_read(
    sidecar: Any, kit: Any
):
    fingerprint = kit.NAMESPACE.fingerprint()
    legit = RawPeer(sidecar.endpoint)
    legit.hello(fingerprint)
    strangers = [RawPeer(sidecar.endpoint) for _ in range(PEERS)]
    for i, peer in enumerate(strangers):  # one with no session id, the others a made-up one
        peer.send(_maximal_load_blocks(fingerprint, "" if i == 0 else f"forged-{i}"))
    assert legit.call(p.PING, {}, request_id=3)[2] is True
    for peer in strangers:
        _, request_id, ok, body = peer.receive()
        # On 4edd4cb every body was read and checked item by item first, so the
        # answer was the bad block id (bad_request), after all that work.
        assert (ok, request_id, body["code"]) == (False, 7, p.E_NO_SESSION), body
    assert _errors(sidecar, p.E_BAD_REQUEST) == 0
    # The same frame from the session's own peer is read in full and refused by name.
    legit.send(_maximal_load_blocks(fingerprint, legit.session_id))
    _, request_id, ok, body = legit.receive()
    assert (ok, request_id, body["code"]) == (False, 7, p.E_BAD_REQUEST)
    assert f"block_ids[{p.MAX_KEYS - 1}][129]" in body["message"]
    for peer in [legit, *strangers]:
        peer.close()
