"""StorageManager: the engine API the sidecar server codes against."""

from __future__ import annotations

import os
import random
import threading
import time

from kvstrata.sidecar.engine import StorageManager
from kvstrata.sidecar.objformat import ChunkMeta
from kvstrata.sidecar.tiers.disk import DiskTier

from ..conftest import engine_config, make_key, payload_for

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
    assert second.stats().counters.promotions_total["l2"] == 1


# -- capacity, eviction and leases --------------------------------------------


def test_a_full_arena_evicts_instead_of_failing(make_engine):
    engine = make_engine(l2={"enabled": False})
    keys = [make_key(i) for i in range(600)]  # 600 x 4 KiB > 1 MiB
    for key in keys:
        assert engine.put(key, payload_for(key, 4096), META)
    stats = engine.stats().tiers["l1"]
    assert stats.evictions_total > 0
    assert stats.usage_bytes <= stats.capacity_bytes
    assert engine.get(keys[-1]) == payload_for(keys[-1], 4096)
    assert engine.get(keys[0]) is None


def test_a_leased_object_is_never_evicted_and_reserve_is_none_when_all_is_leased(make_engine):
    engine = make_engine(l2={"enabled": False})
    first = make_key(0)
    engine.put(first, payload_for(first, 4096), META)
    held = engine.acquire(first, "reader")
    slots = []
    for i in range(1, 1000):
        slot = engine.reserve(make_key(i), 4096, META, "writer")
        if slot is None:
            break
        slots.append(slot)
    assert slot is None, "reserve must say None once every byte is leased"
    assert len(slots) == 255  # 1 MiB / 4 KiB, minus the held chunk
    view = engine.arena.buffer[held.offset : held.offset + held.length]
    assert bytes(view) == payload_for(first, 4096)
    assert engine.stats().counters.store_rejected_total == 1
    engine.release(held)
    assert engine.reserve(make_key(5000), 4096, META, "writer") is not None


def test_l1_and_l2_stay_within_their_bytes_under_a_random_workload(make_engine):
    rng = random.Random(11)
    engine = make_engine(l2={"size_bytes": "2Mi"})
    for step in range(400):
        key = make_key(rng.randint(0, 300))
        n = rng.choice([1000, 4096, 20_000, 70_000])
        roll = rng.random()
        if roll < 0.5:
            engine.put(key, payload_for(key, n), ChunkMeta("uint8", (n,)))
        elif roll < 0.9:
            got = engine.get(key)
            assert got is None or got == payload_for(key, len(got))
        else:
            engine.remove(key)
        stats = engine.stats()
        assert stats.tiers["l1"].usage_bytes <= stats.tiers["l1"].capacity_bytes, step
        assert stats.tiers["l2"].usage_bytes <= stats.tiers["l2"].capacity_bytes, step
    assert engine.flush(10)
    assert engine.stats().gauges.leases_active == 0


def test_prefix_aware_eviction_keeps_chain_heads(make_engine):
    engine = make_engine(l1={"prefix_aware": True, "policy": "lru"}, l2={"enabled": False})
    chain = [make_key(i) for i in range(200)]
    parent = None
    for key in chain:  # 200 x 4 KiB: fits
        engine.put(key, payload_for(key, 4096), META, parent=parent)
        parent = key
    for i in range(200, 300):  # 100 unrelated chunks push 44 out
        engine.put(make_key(i), payload_for(make_key(i), 4096), META)
    result = engine.lookup(chain)
    assert 0 < result.hit_chunks < 200  # the head survives, the tail went
    assert all(t == "l1" for t in result.tiers)


def test_expired_leases_are_dropped_and_unpin(make_engine):
    engine = make_engine(l2={"enabled": False}, server={"lease_seconds": 1.0})
    key = make_key(1)
    engine.put(key, payload_for(key, 4096), META)
    # The leases are stamped between these two readings of the engine's
    # clock: ``now`` is handed to expire_leases relative to them.
    before = time.monotonic()
    engine.acquire(key, "gone")
    writing = engine.reserve(make_key(2), 4096, META, "gone")
    after = time.monotonic()
    assert engine.stats().gauges.leases_active == 2
    assert engine.expire_leases(now=before + 0.999) == 0  # younger than lease_seconds
    assert engine.expire_leases(now=after + 1.001) == 2
    assert engine.stats().gauges.leases_active == 0
    assert not engine.commit(writing)  # its lease expired: the chunk never appears
    assert engine.lookup([make_key(2)]).hit_chunks == 0


def test_release_owner_drops_every_lease_of_that_owner(make_engine):
    engine = make_engine(l2={"enabled": False})
    keys = [make_key(i) for i in range(3)]
    for key in keys:
        engine.put(key, payload_for(key, 4096), META)
    for key in keys:
        engine.acquire(key, "client-a")
    engine.acquire(keys[0], "client-b")
    assert engine.release_owner("client-a") == 3
    assert engine.stats().gauges.leases_active == 1


def test_remove_of_a_leased_chunk_keeps_its_bytes_until_release(make_engine):
    engine = make_engine()
    key = make_key(1)
    engine.put(key, payload_for(key, 4096), META)
    slot = engine.acquire(key, "reader")
    engine.remove(key)
    assert engine.lookup([key]).hit_chunks == 0
    for i in range(2, 400):  # churn: the removed chunk's extent must stay untouched
        engine.put(make_key(i), payload_for(make_key(i), 4096), META)
    assert bytes(engine.arena.buffer[slot.offset : slot.offset + 4096]) == payload_for(key, 4096)
    engine.release(slot)


# -- lower tiers ----------------------------------------------------------------


def test_prefetch_brings_l2_chunks_into_l1_under_the_owners_leases(make_engine):
    first = make_engine()
    keys = [make_key(i) for i in range(8)]
    for key in keys:
        first.put(key, payload_for(key, 4096), META)
    assert first.flush(5)
    first.close()
    engine = make_engine()
    assert engine.prefetch(keys, "req-1") == 8
    assert engine.flush(5)
    assert engine.lookup(keys).tiers == ["l1"] * 8
    assert engine.stats().gauges.leases_active == 8
    assert engine.release_owner("req-1") == 8
    for key in keys:
        assert engine.get(key) == payload_for(key, 4096)


def test_a_corrupt_l2_object_is_a_counted_miss_through_the_engine(make_engine):
    first = make_engine()
    key = make_key(1)
    first.put(key, payload_for(key, 4096), META)
    assert first.flush(5)
    path = first.l2.path_of(key)
    first.close()
    with open(path, "r+b") as fh:
        fh.seek(-10, os.SEEK_END)
        fh.write(b"XXXXXXXXXX")
    engine = make_engine()
    assert engine.lookup([key]).tiers == ["l2"]
    assert engine.acquire(key, "r") is None
    assert engine.stats().tiers["l2"].corrupt_total == 1
    assert engine.stats().counters.promotion_failures_total == 1
    assert engine.lookup([key]).hit_chunks == 0


class SharedDirTier(DiskTier):
    """A real directory tier standing in as the shared tier (one more L2)."""

    name = "shared"


def test_shared_tier_hits_are_looked_up_and_promoted(tmp_path):
    shared = SharedDirTier(tmp_path / "shared", 1 << 22)
    keys = [make_key(i) for i in range(4)]
    for key in keys:
        shared.put(key, payload_for(key, 4096), META)
    config = engine_config(tmp_path, l2={"enabled": False})
    with StorageManager(config, shared_tier=shared) as engine:
        assert engine.lookup([*keys, make_key(99)]).tiers == ["shared"] * 4
        assert engine.get(keys[1]) == payload_for(keys[1], 4096)
        assert engine.lookup(keys[:2]).tiers == ["shared", "l1"]
        assert engine.stats().counters.promotions_total["shared"] == 1


def test_admission_all_uploads_at_commit_and_reused_on_first_hit(tmp_path):
    for admission, uploaded_before_hit in (("all", True), ("reused", False)):
        shared = SharedDirTier(tmp_path / admission, 1 << 22)
        config = engine_config(tmp_path, shared={"admission": admission})
        with StorageManager(config, shared_tier=shared) as engine:
            key = make_key(1)
            engine.put(key, payload_for(key, 4096), META)
            assert engine.flush(5)
            assert shared.contains_many([key]) == [uploaded_before_hit], admission
            engine.get(key)
            assert engine.flush(5)
            assert shared.contains_many([key]) == [True], admission
            engine.get(key)
            assert engine.flush(5)
            assert engine.stats().tiers["shared"].stored_bytes_total == 4096  # once


class GatedDirTier(SharedDirTier):
    """FaultInjecting: a shared tier whose writes hang until the test opens
    the gate (a stalled remote cannot be caused reliably otherwise)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()

    def put(self, key, payload, meta):
        self.gate.wait(10)
        return super().put(key, payload, meta)


def test_a_queued_write_pins_its_l1_object_until_written(tmp_path):
    shared = GatedDirTier(tmp_path / "gated", 1 << 22)
    config = engine_config(tmp_path, l2={"enabled": False})
    with StorageManager(config, shared_tier=shared) as engine:
        key = make_key(0)
        engine.put(key, payload_for(key, 4096), META)
        for i in range(1, 400):  # the arena holds 256: older chunks get evicted
            engine.put(make_key(i), payload_for(make_key(i), 4096), META)
        assert engine.stats().tiers["shared"].dropped_total > 0  # the queue was full
        assert engine.lookup([key]).hit_chunks == 1, "pinned by its queued write"
        shared.gate.set()
        assert engine.flush(10)
        assert shared.get(key) is not None
        assert bytes(shared.get(key).payload) == payload_for(key, 4096)
        assert engine.stats().gauges.writeback_pinned_bytes == 0


# -- concurrency and speed --------------------------------------------------------


def test_concurrent_readers_and_writers_get_full_correct_bytes_or_a_miss(make_engine):
    engine = make_engine(l1={"size_bytes": "2Mi"}, l2={"size_bytes": "2Mi"})
    keys = [make_key(i) for i in range(64)]
    errors: list[str] = []
    stop = time.monotonic() + 1.5

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < stop:
            key = rng.choice(keys)
            n = 8192 + (key[-1] * 97)  # size derived from the key
            if rng.random() < 0.4:
                engine.put(key, payload_for(key, n), ChunkMeta("uint8", (n,)))
            elif rng.random() < 0.1:
                engine.remove(key)
            else:
                got = engine.get(key)
                if got is not None and got != payload_for(key, n):
                    errors.append(f"wrong bytes for {key.hex()[:8]}")

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert engine.flush(10)
    assert engine.stats().gauges.leases_active == 0


def test_lease_ids_are_never_reused(make_engine):
    engine = make_engine(l2={"enabled": False})
    seen: set[int] = set()
    for i in range(60):
        key = make_key(i % 6)
        write = engine.reserve(key, 4096, META, "w")
        if write is not None:
            assert write.lease_id not in seen
            seen.add(write.lease_id)
            if i % 4:
                engine.commit(write)
            else:
                engine.release_lease(write.lease_id)  # abandons the reservation
        read = engine.acquire(key, "r")
        if read is not None:
            assert read.lease_id not in seen
            seen.add(read.lease_id)
        engine.release_owner("r")
    assert len(seen) > 60


def test_a_chunk_larger_than_the_arena_is_refused_not_raised(make_engine):
    engine = make_engine(l2={"enabled": False})
    assert engine.reserve(make_key(1), 2 << 20, META, "w") is None
    assert not engine.put(make_key(1), b"x" * (2 << 20), META)
