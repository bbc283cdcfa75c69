"""Partial chunks in the engine: header block count, lookup, replacement."""

from __future__ import annotations

import pytest

from kvstrata.sidecar.objformat import ChunkMeta, decode, decode_header, encode_bytes

from ..conftest import make_key, payload_for

FULL = ChunkMeta("uint8", (4, 1024))


def partial(blocks: int) -> ChunkMeta:
    return ChunkMeta("uint8", (blocks, 1024), blocks=blocks)


def put_partial(engine, key, blocks: int) -> bool:
    return engine.put(key, payload_for(key, blocks * 1024), partial(blocks))


@pytest.mark.parametrize("blocks", [0, 1, 3, 0xFFFF])
def test_the_block_count_round_trips_through_the_object_header(blocks):
    key = make_key(1)
    blob = encode_bytes(key, b"x" * 64, ChunkMeta("uint8", (64,), blocks=blocks))
    assert decode_header(blob, key).meta.blocks == blocks
    assert decode(blob, key).meta == ChunkMeta("uint8", (64,), blocks=blocks)


def test_a_partial_is_a_miss_where_a_full_chunk_is_expected_in_every_tier(make_engine):
    first = make_engine()
    key = make_key(1)
    assert put_partial(first, key, 3)
    assert first.acquire(key, "a", blocks=0) is None  # L1
    slot = first.acquire(key, "a", blocks=3)
    assert slot is not None and slot.length == 3 * 1024
    first.release(slot)
    assert first.stats().counters.partial_mismatch_total == 1
    assert first.flush(5)
    first.close()
    second = make_engine()  # a restart: the partial is only in L2
    assert second.acquire(key, "a", blocks=0) is None
    slot = second.acquire(key, "a", blocks=3)
    assert slot is not None and slot.meta.blocks == 3
    assert bytes(second.arena.buffer[slot.offset : slot.offset + slot.length]) == payload_for(
        key, 3 * 1024
    )


def test_lookup_partial_answers_the_first_candidate_held(make_engine):
    engine = make_engine()
    candidates = [make_key(i) for i in (13, 12, 11)]  # longest first
    assert engine.lookup_partial(candidates) is None
    put_partial(engine, candidates[1], 2)
    assert engine.lookup_partial(candidates) == (1, "l1")
    put_partial(engine, candidates[0], 3)
    assert engine.lookup_partial(candidates) == (0, "l1")
    assert engine.stats().counters.partial_hits_total == 2


def test_a_longer_partial_replaces_the_shorter_ones_in_l1_and_l2(make_engine):
    engine = make_engine()
    short, longer = make_key(11), make_key(12)
    put_partial(engine, short, 1)
    assert engine.flush(5)
    assert engine.drop_partials([short], replaced=True) == 1
    put_partial(engine, longer, 2)
    assert engine.lookup_partial([longer, short]) == (0, "l1")
    assert engine.lookup_partial([short]) is None
    assert engine.l2 is not None and not engine.l2.contains(short)
    counters = engine.stats().counters
    assert counters.partial_replaced_total == 1
    assert counters.partial_stored_total == 2


def test_storing_the_full_chunk_drops_the_partials_it_covers_but_never_full_chunks(make_engine):
    engine = make_engine()
    inside, full_neighbour = make_key(21), make_key(22)
    put_partial(engine, inside, 2)
    engine.put(full_neighbour, payload_for(full_neighbour, 4096), FULL)
    assert engine.flush(5)
    engine.close()  # and a restart: L2 alone tells which objects are partial
    again = type(engine)(engine.config)
    try:
        assert again.drop_partials([inside, full_neighbour], replaced=False) == 1
        assert again.lookup([full_neighbour]).hit_chunks == 1
        assert again.lookup_partial([inside]) is None
        assert again.stats().counters.partial_dropped_total == 1
    finally:
        again.close()


def test_a_partial_chunk_takes_only_its_own_bytes_in_l1(make_engine):
    engine = make_engine(l2={"enabled": False})
    key = make_key(31)
    put_partial(engine, key, 1)
    assert engine.stats().tiers["l1"].usage_bytes == 1024


# -- admission into a full L1 ------------------------------------------------------

CHUNK_BYTES = 4096


def _l1_of(chunks: int, policy: str = "lru"):
    from kvstrata.sidecar.l1 import L1Store

    return L1Store(chunks * CHUNK_BYTES, policy=policy)


def _put(store, key, meta: ChunkMeta, nbytes: int = CHUNK_BYTES) -> bool:
    entry = store.reserve(key, nbytes, meta)
    if entry is None:
        return False
    store.publish(entry)
    store.unpin(entry)
    return True


@pytest.mark.parametrize("policy", ["lru", "fifo", "lfu", "s3fifo"])
def test_a_partial_chunk_never_evicts_a_full_chunk(policy):
    store = _l1_of(4, policy)
    full = [make_key(i) for i in range(4)]
    for key in full:
        assert _put(store, key, FULL)
    # L1 is full of full chunks: the prompt's tail is not admitted.
    assert not _put(store, make_key(100), partial(2), 2 * 1024)
    assert all(key in store.entries for key in full)
    assert store.evictions_total == 0


def test_a_partial_chunk_evicts_other_partial_chunks_only():
    store = _l1_of(4)
    full = [make_key(i) for i in range(3)]
    for key in full:
        assert _put(store, key, FULL)
    tails = [make_key(200), make_key(201)]
    for key in tails:
        assert _put(store, key, partial(2), CHUNK_BYTES // 2)
    # L1 is full; the least recently used entries are full chunks.
    newer = make_key(202)
    assert _put(store, newer, partial(3), CHUNK_BYTES // 2)
    assert all(key in store.entries for key in full)
    assert newer in store.entries
    assert sum(key in store.entries for key in tails) == 1
    assert store.evictions_total == 1


def test_a_full_chunk_still_evicts_in_policy_order_partials_included():
    store = _l1_of(2)
    tail, older = make_key(300), make_key(301)
    assert _put(store, older, FULL)
    assert _put(store, tail, partial(2), CHUNK_BYTES)
    store.policy.on_access(older)  # the partial is now the coldest
    assert _put(store, make_key(302), FULL)
    assert tail not in store.entries and older in store.entries


def test_a_partial_chunk_promoted_for_a_reader_may_evict_a_full_chunk():
    """A promotion answers a hit a lookup already gave: refusing it would turn
    that hit into a load error."""
    store = _l1_of(2)
    full = [make_key(400), make_key(401)]
    for key in full:
        assert _put(store, key, FULL)
    entry = store.reserve(make_key(402), CHUNK_BYTES, partial(2), read_now=True)
    assert entry is not None
    assert sum(key in store.entries for key in full) == 1
