"""StorageManager: the engine API the sidecar server codes against."""

from __future__ import annotations

import os

from kvstrata.sidecar.objformat import ChunkMeta

from .conftest import make_key, payload_for

META = ChunkMeta("uint8", (4096,))


def test_put_then_get_returns_the_same_bytes(make_engine):
    engine = make_engine()
    key = make_key(1)
    assert engine.put(key, payload_for(key, 4096), META)
    assert engine.get(key) == payload_for(key, 4096)
    assert engine.get(make_key(2)) is None


def test_lookup_reports_the_longest_contiguous_prefix(make_engine):
    engine = make_engine()
    keys = [make_key(i) for i in range(6)]
    for key in keys[:3] + keys[4:]:
        engine.put(key, payload_for(key, 4096), META)
    result = engine.lookup(keys)
    assert result.hit_chunks == 3
    assert result.tiers == ["l1", "l1", "l1"]


def test_reserve_of_a_stored_key_is_none(make_engine):
    engine = make_engine()
    key = make_key(1)
    slot = engine.reserve(key, 4096, META, "a")
    assert slot is not None
    assert engine.reserve(key, 4096, META, "b") is None  # being written
    engine.arena.buffer[slot.offset : slot.offset + slot.length] = payload_for(key, 4096)
    assert engine.commit(slot)
    assert engine.reserve(key, 4096, META, "b") is None  # stored
    assert not engine.commit(slot)  # a lease commits once


def test_uncommitted_reservation_is_invisible_and_abort_frees_it(make_engine):
    engine = make_engine()
    key = make_key(1)
    slot = engine.reserve(key, 4096, META, "a")
    assert engine.lookup([key]).hit_chunks == 0
    assert engine.acquire(key, "b") is None
    engine.abort(slot)
    assert engine.stats().tiers["l1"].usage_bytes == 0
    assert engine.reserve(key, 4096, META, "a") is not None


def test_a_client_process_sees_committed_bytes_through_the_segment(make_engine):
    engine = make_engine()
    key = make_key(7)
    engine.put(key, payload_for(key, 4096), META)
    slot = engine.acquire(key, "reader")
    with open(f"/dev/shm/{engine.arena.name}", "rb") as fh:
        fh.seek(slot.offset)
        assert fh.read(slot.length) == payload_for(key, 4096)
    assert engine.release_lease(slot.lease_id)
    assert not engine.release_lease(slot.lease_id)


def test_close_unlinks_the_segment(make_engine):
    engine = make_engine()
    path = f"/dev/shm/{engine.arena.name}"
    assert os.path.exists(path)
    engine.close()
    assert not os.path.exists(path)


def test_l2_hit_is_promoted_into_l1_after_a_restart(make_engine):
    first = make_engine()
    keys = [make_key(i) for i in range(4)]
    for key in keys:
        first.put(key, payload_for(key, 4096), META)
    assert first.flush(5)
    first.close()
    second = make_engine()
    assert second.lookup(keys).tiers == ["l2"] * 4
    assert second.get(keys[2]) == payload_for(keys[2], 4096)
    assert second.lookup(keys[2:3]).tiers == ["l1"]
    assert second.stats().counters["promotions_total_l2"] == 1
