"""A lookup that fetches ahead asks S3 with GETs and the fetch reads their bodies.

Real moto server; requests are counted by the tier's own boto3 client
(``before-call`` events), so each test says how many HEADs and GETs the
endpoint saw.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import pytest

from kvstrata.sidecar.config import SidecarConfig
from kvstrata.sidecar.engine import StorageManager
from kvstrata.sidecar.keys import ChunkKey, Namespace, make_key
from kvstrata.sidecar.objformat import ChunkMeta
from kvstrata.sidecar.tiers.s3 import S3Tier
from kvstrata.testing.poll import wait_until

NS = Namespace(model="s3-ahead").fingerprint()
SIZE = 64 << 10
META = ChunkMeta(dtype="uint8", shape=(SIZE,))


def key(i: int) -> ChunkKey:
    return make_key(NS, i.to_bytes(32, "big"))


def payload(i: int) -> bytes:
    return bytes([i % 251]) * SIZE


class Requests:
    """S3 operations a tier's client sent, by name (``HeadObject``, ``GetObject``)."""

    def __init__(self, tier: S3Tier) -> None:
        self.sent: collections.Counter[str] = collections.Counter()
        tier._client.meta.events.register("before-call.s3.*", self._count)

    def _count(self, model: Any, **_: Any) -> None:
        self.sent[model.name] += 1

    def take(self) -> dict[str, int]:
        got = {op: n for op, n in self.sent.items() if op in ("HeadObject", "GetObject")}
        self.sent.clear()
        return got


@pytest.fixture
def tiers(s3_tiers: Callable[..., S3Tier]) -> Callable[..., S3Tier]:
    return s3_tiers


def _stored(writer: S3Tier, indexes: list[int]) -> None:
    assert all(writer.put_many([(key(i), payload(i), META) for i in indexes]))


def _fetched(tier: S3Tier, i: int) -> bytes | None:
    obj = tier.get(key(i))
    return None if obj is None else bytes(obj.payload)


def test_a_lookup_ahead_costs_one_get_per_chunk_and_the_fetch_reads_its_body(tiers):
    _stored(tiers(), [0, 1, 2, 3])
    reader = tiers()
    requests = Requests(reader)
    assert reader.contains_many_ahead([key(i) for i in range(4)]) == [True] * 4
    assert requests.take() == {"GetObject": 4}
    for i in range(4):
        assert _fetched(reader, i) == payload(i)
    assert requests.take() == {}, "the fetches sent requests of their own"
    stats = reader.stats()
    assert (stats.lookup_gets_used_total, stats.lookup_gets_closed_total) == (4, 0)
    # The plain question still asks with HEADs and the fetch with GETs.
    assert reader.contains_many([key(0), key(1)]) == [True, True]
    assert _fetched(reader, 0) == payload(0)
    assert requests.take() == {"HeadObject": 2, "GetObject": 1}


def test_responses_after_the_first_missing_chunk_are_closed_not_held(tiers):
    _stored(tiers(), [0, 1, 3])
    reader = tiers()
    requests = Requests(reader)
    keys = [key(i) for i in range(4)]
    assert reader.contains_many_ahead(keys) == [True, True, False, True]
    assert requests.take() == {"GetObject": 4}
    names = [reader._name(k) for k in keys]
    assert [reader._held.holds(n) for n in names] == [True, True, False, False]
    # Chunk 3's response is closed once it has answered (a done-callback).
    wait_until(lambda: reader.stats().lookup_gets_closed_total == 1, 10, "chunk 3 closed")
    # Chunk 3 is still there: fetching it anyway sends a GET of its own.
    assert _fetched(reader, 3) == payload(3)
    assert requests.take() == {"GetObject": 1}


def test_keys_held_already_are_answered_without_a_request(tiers):
    _stored(tiers(), [0, 1])
    reader = tiers()
    requests = Requests(reader)
    assert reader.contains_many_ahead([key(0)]) == [True]
    assert reader.contains_many_ahead([key(0), key(1)]) == [True, True]
    assert requests.take() == {"GetObject": 2}
    assert _fetched(reader, 0) == payload(0)
    assert _fetched(reader, 1) == payload(1)
    assert requests.take() == {}


def test_keys_beyond_the_room_to_hold_are_asked_with_heads(tiers):
    _stored(tiers(), list(range(6)))
    reader = tiers(s3={"max_concurrency": 1})  # room for 4 held responses
    assert reader._held.capacity == 4
    requests = Requests(reader)
    assert reader.contains_many_ahead([key(i) for i in range(6)]) == [True] * 6
    assert requests.take() == {"GetObject": 4, "HeadObject": 2}
    assert [_fetched(reader, i) for i in range(6)] == [payload(i) for i in range(6)]
    assert requests.take() == {"GetObject": 2}


def test_a_held_response_whose_connection_broke_is_fetched_again(tiers):
    _stored(tiers(), [0])
    reader = tiers()
    requests = Requests(reader)
    assert reader.contains_many_ahead([key(0)]) == [True]
    held = reader._held._held[reader._name(key(0))][0]
    held["Body"].close()  # the held connection is gone before the fetch reads it
    assert _fetched(reader, 0) == payload(0)
    assert requests.take() == {"GetObject": 2}
    assert reader.stats().errors_total == {}


def test_a_sidecar_engine_warms_from_s3_with_one_request_per_chunk(tiers, tmp_path):
    """LOOKUP with prefetch, as the handler runs it, then the fetches it started."""
    _stored(tiers(), [0, 1, 2])
    reader = tiers()
    requests = Requests(reader)
    config = SidecarConfig.model_validate(
        {"chunk_size": 16, "l1": {"size_bytes": 8 << 20}, "l2": {"enabled": False}}
    )
    engine = StorageManager(config, shared_tier=reader)
    try:
        keys = [key(i) for i in range(3)] + [key(9)]
        found = engine.lookup(keys, fetch_ahead=True)
        assert found.hit_chunks == 3
        assert engine.prefetch(keys[:3], "client/req") == 3
        assert engine.flush(timeout=30)
        assert requests.take() == {"GetObject": 4}  # the 4th answered "missing"
        for i in range(3):
            slot = engine.acquire(keys[i], "client/req")
            assert slot is not None
            assert bytes(engine.arena.buffer[slot.offset : slot.offset + slot.length]) == payload(i)
            engine.release(slot)
        assert requests.take() == {}
    finally:
        engine.close()
