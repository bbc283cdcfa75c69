"""The load_tiers / store_tiers fields: role names checked at the boundary,
the shared tier matched whatever its backend, and write-behind asking one
function where a stored chunk may go."""

from __future__ import annotations

from typing import Any

import pytest

from kvstrata.sidecar import protocol as p
from kvstrata.sidecar.messages import LookupRequest, PrepareStoreRequest
from kvstrata.sidecar.tierchoice import allows, read_tiers

from ..conftest import make_key


def test_a_left_out_field_means_every_tier():
    assert read_tiers(None, "load_tiers") is None
    assert allows(None, "valkey") and allows(None, "l2")


def test_the_shared_role_names_the_shared_tier_whatever_its_backend():
    choice = read_tiers(["l1", "shared"], "load_tiers")
    assert allows(choice, "l1") and allows(choice, "valkey") and allows(choice, "s3")
    assert not allows(choice, "l2")


@pytest.mark.parametrize(
    ("value", "words"),
    [
        (["l1", "l3"], ["'load_tiers'", "'l3'", "l1, l2, shared"]),
        ([], ["'load_tiers'", "empty"]),
        ("l1", ["'load_tiers'", "a list"]),
        ([1], ["'load_tiers[0]'", "a string"]),
        (["l1", "l2", "shared", "l1"], ["'load_tiers'", "at most 3"]),
    ],
    ids=repr,
)
def test_a_bad_tier_list_is_refused_naming_the_field(value: Any, words: list[str]):
    with pytest.raises(p.ProtocolError) as caught:
        read_tiers(value, "load_tiers")
    assert caught.value.code == p.E_BAD_REQUEST
    for word in words:
        assert word in str(caught.value)


def test_store_tiers_without_l1_are_refused():
    body = {"keys": [make_key(1)], "nbytes": 8, "dtype": "uint8", "shape": [8], "owner": "r",
            "store_tiers": ["l2"]}  # fmt: skip
    with pytest.raises(p.ProtocolError, match="'store_tiers': must include 'l1'"):
        PrepareStoreRequest.from_wire(body)


def test_the_fields_round_trip_and_are_left_out_of_the_frame_when_unset():
    ask = LookupRequest(keys=[make_key(1)], owner="r", load_tiers=frozenset({"l2", "l1"}))
    assert ask.to_wire()["load_tiers"] == ["l1", "l2"]
    assert LookupRequest.from_wire(ask.to_wire()).load_tiers == {"l1", "l2"}
    assert "load_tiers" not in LookupRequest(keys=[make_key(1)], owner="r").to_wire()
    store = PrepareStoreRequest(keys=[make_key(1)], nbytes=8, shape=(8,), owner="r",
                                store_tiers=frozenset({"l1"}))  # fmt: skip
    assert PrepareStoreRequest.from_wire(store.to_wire()).store_tiers == {"l1"}


def test_write_behind_copies_a_chunk_only_where_its_request_let_it_go(make_engine: Any):
    from kvstrata.sidecar.objformat import ChunkMeta

    engine = make_engine()
    meta = ChunkMeta("uint8", (4096,))
    kept, free = make_key(1), make_key(2)
    for key, tiers in ((kept, frozenset({"l1"})), (free, None)):
        slot = engine.reserve(key, 4096, meta, "c:r", store_tiers=tiers)
        assert slot is not None
        assert engine.commit(slot)
    assert engine.flush(timeout=30)
    assert engine.l2 is not None
    assert not engine.l2.contains(kept) and engine.l2.contains(free)
