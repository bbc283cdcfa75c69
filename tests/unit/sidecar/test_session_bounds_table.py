"""The session table's per-peer and per-uid bounds (no server needed)."""

from __future__ import annotations

import pytest

from kvstrata.sidecar.sessions import SessionLimit, SessionTable
from kvstrata.sidecar.transfer_mode import TransferMode

FP = b"f" * 16


def _open(table: SessionTable, client: str, peer: bytes, uid: int | None = 1000) -> str:
    session, _ = table.open(client, "worker", 7, TransferMode.HOST, peer, FP, uid=uid)
    return session.session_id


def test_a_hello_that_replaces_its_own_session_passes_a_full_peer():
    table = SessionTable(60.0, max_per_peer=2, max_per_uid=10)
    _open(table, "a", b"peer")
    _open(table, "b", b"peer")
    _open(table, "b", b"peer")  # the same client again: replaces, does not add
    assert len(table) == 2
    with pytest.raises(SessionLimit) as refused:
        _open(table, "c", b"peer")
    assert refused.value.bound == "sessions_per_peer"


def test_ended_sessions_give_their_place_back_to_peer_and_uid():
    table = SessionTable(60.0, max_per_peer=5, max_per_uid=2)
    first = _open(table, "a", b"p1")
    _open(table, "b", b"p2")
    with pytest.raises(SessionLimit) as refused:
        _open(table, "c", b"p3")
    assert refused.value.bound == "sessions_per_uid"
    _open(table, "c", b"p3", uid=2000)  # another uid has its own bound
    _open(table, "d", b"p4", uid=None)  # no uid known (tcp): the peer bound only
    assert table.remove(first) is not None
    _open(table, "e", b"p5")
    assert len(table) == 4
