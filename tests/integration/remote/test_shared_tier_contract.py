"""The Tier contract, run against every tier below L1.

Backends: one Valkey/Redis server, a 3-node Valkey cluster, moto's S3 HTTP
endpoint (all real servers, see conftest.py) and the local-disk L2 tier.
Corruption is caused with each backend's own raw access (client or file),
exactly as a bad disk, a buggy writer or a stray key would.
"""

from __future__ import annotations

import os
import struct
from dataclasses import asdict

import pytest
import xxhash

from kvstrata.bench.kvdata import bf16_kv_like
from kvstrata.sidecar import objformat_write
from kvstrata.sidecar.keys import ChunkKey, Namespace, make_key
from kvstrata.sidecar.objformat import ChunkMeta, decode_header, encode_bytes
from kvstrata.sidecar.tiers.stats import BreakerStats, S3Stats, ValkeyStats

NS = Namespace(model="contract-test").fingerprint()
META = ChunkMeta(dtype="bfloat16", shape=(2, 4, 64))


def random_key() -> ChunkKey:
    return make_key(NS, os.urandom(32))


def payload(seed: int = 0) -> bytes:
    return bf16_kv_like(2 * 4 * 64 * 2, seed=seed)


def test_put_then_get_returns_the_same_bytes_and_meta(backend) -> None:
    tier, _ = backend.make_tier()
    key, data = random_key(), payload(1)
    assert tier.put(key, data, META)
    got = tier.get(key)
    assert got is not None
    assert bytes(got.payload) == data
    assert got.meta == META
    stats = tier.stats()
    assert stats.hits_total == 1
    assert stats.stored_bytes_total >= len(data)
    assert not stats.degraded


def test_the_stats_carry_only_the_parts_the_tier_has(backend) -> None:
    """A shared tier's breaker, its backend's own figures, none for the disk
    tier; /status (their asdict) names no other backend's fields."""
    tier, _ = backend.make_tier()
    stats = tier.stats()
    shared = backend.tier_name != "l2"
    assert isinstance(stats.breaker, BreakerStats) == shared
    own = {"l2": type(None), "s3": S3Stats, "valkey": ValkeyStats}[backend.tier_name]
    assert type(stats.backend) is own
    status = asdict(stats)
    assert not {"breaker_state", "refreshed_total", "server_evicted_keys"} & set(status)
    assert status["breaker"] == ({"state": "closed", "opened_total": 0} if shared else None)


def test_missing_key_is_a_counted_miss(backend) -> None:
    tier, _ = backend.make_tier()
    assert tier.get(random_key()) is None
    assert tier.stats().misses_total == 1
    assert tier.stats().errors_total == {}


def test_contains_many_answers_each_key_in_order(backend) -> None:
    tier, _ = backend.make_tier(lookup_timeout_seconds=1.0)
    keys = [random_key() for _ in range(12)]
    stored = {0, 3, 4, 11}
    for i in stored:
        assert tier.put(keys[i], payload(i), META)
    assert tier.contains_many(keys) == [i in stored for i in range(12)]
    assert tier.contains_many([]) == []


def test_remove_forgets_one_object_and_keeps_the_rest(backend) -> None:
    tier, _ = backend.make_tier()
    a, b = random_key(), random_key()
    tier.put(a, payload(1), META)
    tier.put(b, payload(2), META)
    tier.remove(a)
    tier.remove(random_key())  # absent keys are fine
    assert tier.get(a) is None
    assert tier.get(b) is not None


def test_remove_many_forgets_those_objects_absent_ones_included(backend) -> None:
    tier, _ = backend.make_tier()
    keys = [random_key() for _ in range(5)]
    for i, key in enumerate(keys):
        assert tier.put(key, payload(i), META)
    never_stored = random_key()
    tier.remove_many([keys[0], keys[2], keys[4], never_stored])
    assert [tier.get(k) is not None for k in keys] == [False, True, False, True, False]
    assert tier.stats().errors_total == {}


def test_clear_forgets_only_this_tiers_prefix(backend) -> None:
    mine, _ = backend.make_tier()
    other, _ = backend.make_tier()  # another prefix on the same server
    keys = [random_key() for _ in range(5)]
    for i, key in enumerate(keys):
        mine.put(key, payload(i), META)
        other.put(key, payload(i), META)
    mine.clear()
    assert mine.contains_many(keys) == [False] * 5
    assert other.contains_many(keys) == [True] * 5


def test_second_put_of_a_stored_key_is_deduplicated(backend) -> None:
    tier, _ = backend.make_tier()
    key = random_key()
    assert tier.put(key, payload(1), META)
    stored_once = tier.stats().stored_bytes_total
    assert tier.put(key, payload(1), META)
    assert tier.stats().deduplicated_total == 1
    assert tier.stats().stored_bytes_total == stored_once


def test_flipped_byte_in_stored_object_is_a_miss_counted_and_deleted(backend) -> None:
    tier, raw = backend.make_tier()
    key = random_key()
    tier.put(key, payload(1), META)
    blob = bytearray(raw.read(raw.name_of(key)))
    blob[-7] ^= 0x40
    raw.write(raw.name_of(key), bytes(blob))
    assert tier.get(key) is None
    assert tier.stats().corrupt_total == 1
    assert raw.read(raw.name_of(key)) is None


def test_truncated_object_is_a_miss(backend) -> None:
    tier, raw = backend.make_tier()
    key = random_key()
    tier.put(key, payload(1), META)
    raw.write(raw.name_of(key), raw.read(raw.name_of(key))[:100])
    assert tier.get(key) is None
    assert tier.stats().corrupt_total == 1


def test_object_stored_under_another_keys_name_is_a_miss(backend) -> None:
    tier, raw = backend.make_tier()
    right, wrong = random_key(), random_key()
    tier.put(right, payload(1), META)
    raw.write(raw.name_of(wrong), raw.read(raw.name_of(right)))
    assert tier.get(wrong) is None
    got = tier.get(right)
    assert got is not None and bytes(got.payload) == payload(1)


@pytest.mark.parametrize("codec", ["zstd", "lz4"])
def test_codec_round_trip_restores_kv_bytes_exactly(shared_backend, codec: str) -> None:
    tier, raw = shared_backend.make_tier(codec=codec)
    key = random_key()
    data = bf16_kv_like(256 * 1024, seed=7)
    meta = ChunkMeta(dtype="bfloat16", shape=(128, 1024))
    assert tier.put(key, data, meta)
    got = tier.get(key)
    assert got is not None and bytes(got.payload) == data and got.meta == meta
    if codec == "zstd":  # bf16 exponents compress; lz4 may fall back to raw
        assert len(raw.read(raw.name_of(key))) < len(data)


def test_bad_meta_is_refused_with_value_error(backend) -> None:
    tier, _ = backend.make_tier()
    with pytest.raises(ValueError, match="dtype"):
        tier.put(random_key(), b"x", ChunkMeta(dtype="a-very-long-dtype-name", shape=(1,)))


def test_put_many_and_get_many_round_trip_a_batch_in_order(backend) -> None:
    tier, raw = backend.make_tier()
    keys = [random_key() for _ in range(9)]
    items = [(k, payload(i), META) for i, k in enumerate(keys)]
    assert tier.put_many(items[:4]) == [True] * 4
    assert tier.put_many(items) == [True] * 9  # the first four are deduplicated
    assert tier.stats().deduplicated_total == 4
    raw.write(raw.name_of(keys[5]), b"garbage")
    got = tier.get_many([*keys, random_key()])
    assert [g is not None for g in got] == [True] * 5 + [False] + [True] * 3 + [False]
    assert all(bytes(g.payload) == payload(i) for i, g in enumerate(got) if g is not None)
    assert tier.stats().corrupt_total == 1
    assert tier.put_many([]) == [] and tier.get_many([]) == []


def test_object_written_in_the_header_checksum_format_is_still_read(shared_backend) -> None:
    # Objects stored before the checksum moved to a trailer (format version 2)
    # stay in users' buckets and servers: they are read, not refused.
    tier, raw = shared_backend.make_tier()
    key, data = random_key(), payload(3)
    raw.write(raw.name_of(key), encode_bytes(bytes(key), data, META))
    got = tier.get(key)
    assert got is not None and bytes(got.payload) == data and got.meta == META
    assert tier.stats().corrupt_total == 0


@pytest.mark.parametrize("size", [64 * 1024, 3 * 1024 * 1024 + 5])
def test_large_object_is_stored_with_a_checksum_trailer_and_read_back(
    shared_backend, size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Pieces smaller than the object, so it goes out (and is hashed) in several.
    monkeypatch.setattr(objformat_write, "PIECE_BYTES", 256 * 1024)
    tier, raw = shared_backend.make_tier()
    key, data = random_key(), bf16_kv_like(size, seed=size)
    meta = ChunkMeta(dtype="uint8", shape=(size,))
    assert tier.put(key, data, meta)
    blob = raw.read(raw.name_of(key))
    header = decode_header(blob, expected_key=bytes(key))
    assert header.trailer
    stored = blob[header.header_length : -8]
    assert stored == data
    assert struct.unpack("<Q", blob[-8:])[0] == xxhash.xxh3_64_intdigest(data)
    got = tier.get(key)
    assert got is not None and bytes(got.payload) == data


@pytest.mark.parametrize("where", ["payload", "trailer"])
def test_flipped_byte_in_a_large_object_is_a_miss(shared_backend, where: str) -> None:
    tier, raw = shared_backend.make_tier()
    key, data = random_key(), bf16_kv_like(1 << 20, seed=5)
    assert tier.put(key, data, ChunkMeta(dtype="uint8", shape=(1 << 20,)))
    blob = bytearray(raw.read(raw.name_of(key)))
    blob[len(blob) // 2 if where == "payload" else -3] ^= 0x10
    raw.write(raw.name_of(key), bytes(blob))
    assert tier.get(key) is None
    assert tier.stats().corrupt_total == 1
