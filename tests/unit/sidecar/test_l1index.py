"""The L1 index on its own: no threads, no tiers, one step after another.

Every test drives an :class:`L1Index` over a small :class:`L1Store` through
its public methods only, and reads what happened through its answers, its
snapshot and a listener that records what it was told.
"""

from __future__ import annotations

from kvstrata.sidecar.keys import ChunkKey
from kvstrata.sidecar.l1 import Entry, L1Store
from kvstrata.sidecar.l1index import L1Index
from kvstrata.sidecar.objformat import ChunkMeta
from kvstrata.sidecar.tierchoice import TierChoice

from ..conftest import make_key

CHUNK = 4096
META = ChunkMeta("uint8", (CHUNK,))
# A cutoff after every lease the test took: expire_leases(LATER) expires them all.
LATER = float("inf")


class RecordingListener:
    """Writes down what the index tells it, and checks the index's lock is free
    then by asking the index something (a held lock would never be released)."""

    def __init__(self, index: L1Index) -> None:
        self.index = index
        self.told: list[tuple[str, ChunkKey]] = []
        self.pinned_when_told: list[bool] = []

    def stored(self, entry: Entry) -> None:
        self.told.append(("stored", entry.key))
        self._pin_and_unpin(entry)

    def read(self, entry: Entry) -> None:
        self.told.append(("read", entry.key))

    def promoted(self, entry: Entry, tier: str) -> None:
        self.told.append((f"promoted from {tier}", entry.key))
        self._pin_and_unpin(entry)

    def shared_choice(self, key: ChunkKey) -> TierChoice:
        return None

    def _pin_and_unpin(self, entry: Entry) -> None:
        pinned = self.index.pin_current(entry)
        self.pinned_when_told.append(pinned)
        if pinned:
            self.index.unpin(entry)


def index_of(chunks: int) -> tuple[L1Index, RecordingListener]:
    index = L1Index(L1Store(chunks * CHUNK, "lru", alignment=256))
    listener = RecordingListener(index)
    index.listen(listener)
    return index, listener


def store(index: L1Index, i: int, owner: str = "s1/req") -> None:
    slot = index.reserve(make_key(i), CHUNK, META, owner, None)
    assert slot is not None
    assert index.commit(slot.lease_id)


def test_a_commit_tells_the_listener_once_with_the_entry_still_in_the_index():
    index, listener = index_of(4)
    slot = index.reserve(make_key(1), CHUNK, META, "s1/req", None)
    assert slot is not None
    assert listener.told == []  # a reservation is nobody's business yet
    assert index.commit(slot.lease_id)
    assert not index.commit(slot.lease_id)  # the lease ended: a second commit is refused
    assert listener.told == [("stored", make_key(1))]
    assert listener.pinned_when_told == [True]
    stats = index.snapshot()
    assert stats.counters.stored_bytes_total == CHUNK
    assert stats.gauges.leases_active == 0


def test_an_abort_frees_the_slot_and_tells_the_listener_nothing():
    index, listener = index_of(1)
    slot = index.reserve(make_key(1), CHUNK, META, "s1/req", None)
    assert slot is not None
    assert index.client_write_bytes("s1") == CHUNK
    assert not index.commit(slot.lease_id, ok=False)
    assert listener.told == []
    assert index.client_write_bytes("s1") == 0
    assert not index.holds(make_key(1))
    store(index, 2)  # the one slot is free again


def test_a_key_held_or_being_written_is_not_reserved_twice():
    index, _ = index_of(4)
    first = index.reserve(make_key(1), CHUNK, META, "s1/req", None)
    assert first is not None
    assert index.reserve(make_key(1), CHUNK, META, "s2/req", None) is None
    assert index.snapshot().counters.store_deduplicated_total == 1


def test_acquire_answers_a_lease_a_miss_to_promote_or_a_chunk_still_being_written():
    index, listener = index_of(4)
    store(index, 1)
    slot, absent = index.acquire(make_key(1), "s1/read", prefetch=False)
    assert slot is not None and not absent
    assert listener.told[-1] == ("read", make_key(1))
    assert index.acquire(make_key(2), "s1/read", prefetch=False) == (None, True)
    writing = index.reserve(make_key(3), CHUNK, META, "s1/write", None)
    assert writing is not None
    assert index.acquire(make_key(3), "s1/read", prefetch=False) == (None, False)
    counters = index.snapshot().counters
    assert (counters.hits_total, counters.misses_total) == (1, 1)
    assert counters.retrieved_bytes_total == CHUNK


def test_a_read_lease_keeps_its_chunk_from_eviction_until_released():
    index, _ = index_of(2)
    store(index, 1)
    slot, _ = index.acquire(make_key(1), "s1/read", prefetch=False)
    assert slot is not None
    store(index, 2)
    store(index, 3)  # evicts 2, not the leased 1
    assert index.ready_run([make_key(1), make_key(2)]) == 1
    assert index.release_lease(slot.lease_id)
    assert not index.release_lease(slot.lease_id)
    store(index, 4)  # 1 is the oldest unpinned now
    assert not index.holds(make_key(1))


def test_an_expired_write_lease_is_quarantined_and_counted_against_its_session():
    index, listener = index_of(4)
    slot = index.reserve(make_key(1), CHUNK, META, "s1/req", None)
    assert slot is not None
    assert index.expire_leases(LATER) == 1
    stats = index.snapshot()
    assert stats.gauges.leases_active == 0
    assert stats.gauges.quarantined_bytes == CHUNK
    assert stats.counters.leases_expired_total == 1
    assert index.client_write_bytes("s1") == CHUNK  # still its bytes
    assert index.client_write_bytes("s2") == 0
    assert not index.holds(make_key(1))  # out of the index at once
    # Its writer comes back late: the commit is refused, and the slot freed.
    assert not index.commit(slot.lease_id)
    assert listener.told == []
    assert index.client_write_bytes("s1") == 0
    assert index.snapshot().gauges.quarantined_bytes == 0


def test_a_quarantined_slot_is_never_handed_to_another_chunk_until_its_writer_is_done():
    index, _ = index_of(2)
    late = index.reserve(make_key(1), CHUNK, META, "s1/req", None)
    assert late is not None
    index.expire_leases(LATER)
    store(index, 2, owner="s2/req")
    # One slot is quarantined: the next store evicts 2 (unpinned) for the other.
    store(index, 3, owner="s2/req")
    assert index.ready_run([make_key(2)]) == 0
    assert index.ready_run([make_key(3)]) == 1
    big = index.reserve(make_key(4), 2 * CHUNK, META, "s2/req", None)
    assert big is None  # the whole arena would need the quarantined slot too
    assert index.snapshot().counters.store_rejected_total == 1
    assert not index.release_lease(late.lease_id)  # its writer says it is done
    index.remove(make_key(3))
    assert index.reserve(make_key(4), 2 * CHUNK, META, "s2/req", None) is not None


def test_release_client_ends_its_leases_frees_its_quarantine_and_refuses_it_from_then_on():
    index, _ = index_of(4)
    assert index.reserve(make_key(3), CHUNK, META, "s1/old", None) is not None
    assert index.expire_leases(LATER) == 1  # quarantined: the only lease so far
    store(index, 1)
    read, _ = index.acquire(make_key(1), "s1/read", prefetch=False)
    write = index.reserve(make_key(2), CHUNK, META, "s1/write", None)
    other = index.reserve(make_key(4), CHUNK, META, "s2/write", None)
    assert None not in (read, write, other)
    assert index.client_write_bytes("s1") == 2 * CHUNK  # the write and the quarantined slot
    assert index.release_client("s1") == 2  # the read and the write lease
    assert index.client_ended("s1") and not index.client_ended("s2")
    assert index.client_write_bytes("s1") == 0
    assert index.snapshot().gauges.quarantined_bytes == 0
    assert index.lease_counts() == {"s2": 1}
    assert index.reserve(make_key(5), CHUNK, META, "s1/new", None) is None
    assert index.acquire(make_key(1), "s1/new", prefetch=False) == (None, False)


def test_release_owner_ends_the_leases_of_that_owner_only():
    index, _ = index_of(4)
    store(index, 1)
    store(index, 2)
    index.acquire(make_key(1), "s1/a", prefetch=False)
    index.acquire(make_key(2), "s1/a", prefetch=False)
    index.acquire(make_key(2), "s1/b", prefetch=False)
    assert index.release_owner("s1/a") == 2
    assert index.lease_counts() == {"s1": 1}


def test_a_prefetch_leases_what_l1_holds_and_plans_the_rest_once_per_owner():
    index, _ = index_of(4)
    store(index, 1)
    keys = [make_key(1), make_key(2), make_key(3)]
    scheduled, to_fetch = index.plan_prefetch(keys, "s1/req", lambda key: key != make_key(3))
    assert (scheduled, to_fetch) == (2, [make_key(2)])  # stops at 3: no tier holds it
    assert index.snapshot().gauges.queued_loads == 1
    again = index.plan_prefetch(keys[:2], "s1/req", lambda key: True)
    assert again == (2, [])  # leased and on its way already: nothing twice
    counters = index.snapshot().counters
    assert counters.prefetch_chunks_total == 2
    assert counters.prefetched_bytes_total == CHUNK and counters.hits_total == 0


def test_a_prefetch_landing_for_a_released_owner_ends_its_lease_at_once():
    index, _ = index_of(4)
    _, to_fetch = index.plan_prefetch([make_key(1)], "s1/req", lambda key: True)
    assert to_fetch == [make_key(1)]
    index.release_owner("s1/req")  # the request ended while the chunk was on its way
    store(index, 1)  # the chunk lands (here: stored; a promotion in the engine)
    slot, _ = index.acquire(make_key(1), "s1/req", prefetch=True)
    assert slot is not None and index.lease_counts() == {"s1": 1}
    index.prefetch_landed("s1/req", make_key(1), slot)
    assert index.lease_counts() == {}
    assert index.snapshot().gauges.queued_loads == 0


def test_a_promotion_is_published_with_a_read_lease_and_told_once():
    index, listener = index_of(4)
    entry, slot = index.reserve_promotion(make_key(1), CHUNK, META, "s1/req", prefetch=False)
    assert entry is not None and slot is None
    published = index.publish_promotion(entry, META, "s1/req", "l2", prefetch=False)
    assert published is not None
    assert listener.told == [("promoted from l2", make_key(1)), ("read", make_key(1))]
    assert listener.pinned_when_told == [True]
    assert index.snapshot().counters.promotions_total == {"l2": 1}
    assert index.release_lease(published.lease_id)
    assert index.snapshot().gauges.leases_active == 0


def test_a_promotion_removed_while_it_was_filled_is_dropped_and_a_failed_one_counted():
    index, listener = index_of(1)
    entry, _ = index.reserve_promotion(make_key(1), CHUNK, META, "s1/req", prefetch=False)
    assert entry is not None
    index.remove(make_key(1))
    assert index.publish_promotion(entry, META, "s1/req", "l2", prefetch=False) is None
    failing, _ = index.reserve_promotion(make_key(2), CHUNK, META, "s1/req", prefetch=False)
    assert failing is not None  # the one slot was freed at the dropped entry's last pin
    index.fail_promotion(failing)
    assert index.snapshot().counters.promotion_failures_total == 1
    assert listener.told == []
    store(index, 3)


def test_a_snapshot_is_a_copy_that_later_counting_leaves_alone():
    index, _ = index_of(2)
    before = index.snapshot()
    with index.tally() as counts:
        counts.partial_hits_total += 1
        counts.hit_chunks_total["l1"] = 3
    after = index.snapshot()
    assert before.counters.partial_hits_total == 0 and before.counters.hit_chunks_total == {}
    assert after.counters.partial_hits_total == 1 and after.counters.hit_chunks_total == {"l1": 3}


def test_a_promotion_that_lands_after_its_client_ended_stays_in_l1_with_no_lease_for_it():
    index, _ = index_of(2)
    entry, _ = index.reserve_promotion(make_key(1), CHUNK, META, "s1/req", prefetch=False)
    assert entry is not None
    index.release_client("s1")  # the session ends while the chunk is read from below
    assert index.publish_promotion(entry, META, "s1/req", "l2", prefetch=False) is None
    assert index.snapshot().gauges.leases_active == 0
    assert index.holds(make_key(1))  # the bytes came up: they stay for others
    slot, _ = index.acquire(make_key(1), "s2/req", prefetch=False)
    assert slot is not None
