"""DiskTier (L2): bounded bytes, restart re-index, corruption is a miss."""

from __future__ import annotations

import os
import random

import pytest

from kvstrata.sidecar.objformat import ChunkMeta, encode_bytes
from kvstrata.sidecar.tiers.disk import DiskTier

from ...conftest import make_key, payload_for

META = ChunkMeta("bfloat16", (2, 1024))


def file_bytes(n: int) -> int:
    key = make_key(0)
    return len(encode_bytes(key, b"\0" * n, META))


def test_put_then_get_round_trips_and_read_into_fills_the_buffer(tmp_path):
    tier = DiskTier(tmp_path, 1 << 20)
    key = make_key(1)
    assert tier.put(key, payload_for(key, 4096), META)
    obj = tier.get(key)
    assert obj is not None and bytes(obj.payload) == payload_for(key, 4096)
    assert obj.meta == META
    buf = bytearray(5000)
    assert tier.read_into(key, memoryview(buf)) == META
    assert bytes(buf[:4096]) == payload_for(key, 4096)
    assert tier.get(make_key(2)) is None
    assert tier.stats().misses_total == 1


def test_files_are_sharded_by_the_keys_last_hex_digits(tmp_path):
    tier = DiskTier(tmp_path, 1 << 20)
    key = make_key(3)
    tier.put(key, b"x" * 10, META)
    path = tier.path_of(key)
    assert os.path.exists(path)
    assert os.path.basename(os.path.dirname(path)) == key.hex()[-2:]


def test_usage_never_exceeds_capacity_and_lru_goes_first(tmp_path):
    per_file = file_bytes(4096)
    tier = DiskTier(tmp_path, 5 * per_file)
    keys = [make_key(i) for i in range(8)]
    for key in keys[:5]:
        assert tier.put(key, payload_for(key, 4096), META)
    assert tier.get(keys[0]) is not None  # keys[0] is now most recently used
    for key in keys[5:]:
        assert tier.put(key, payload_for(key, 4096), META)
        assert tier.stats().usage_bytes <= 5 * per_file
    present = tier.contains_many(keys)
    assert present == [True, False, False, False, True, True, True, True]
    on_disk = sum(len(files) for _, _, files in os.walk(tmp_path))
    assert on_disk == 5


def test_random_workload_stays_within_capacity(tmp_path):
    rng = random.Random(5)
    cap = 200_000
    tier = DiskTier(tmp_path, cap)
    for i in range(300):
        key = make_key(rng.randint(0, 60))
        n = rng.randint(1, 40_000)
        if rng.random() < 0.7:
            tier.put(key, payload_for(key, n), META)
        else:
            obj = tier.get(key)
            assert obj is None or bytes(obj.payload) == payload_for(key, len(obj.payload))
        assert tier.stats().usage_bytes <= cap, f"step {i}"
    on_disk = sum(
        os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(tmp_path) for f in files
    )
    assert on_disk == tier.stats().usage_bytes <= cap


def test_an_object_larger_than_the_tier_is_refused(tmp_path):
    tier = DiskTier(tmp_path, 1000)
    assert not tier.put(make_key(1), b"x" * 2000, META)
    assert tier.stats().objects == 0


def test_a_restarted_tier_finds_what_is_on_disk(tmp_path):
    tier = DiskTier(tmp_path, 1 << 20)
    keys = [make_key(i) for i in range(10)]
    for key in keys:
        tier.put(key, payload_for(key, 3000), META)
    tier.close()
    (tmp_path / "ab").mkdir(exist_ok=True)
    (tmp_path / "ab" / "stale.kvs.tmp-1234").write_bytes(b"half a write")
    again = DiskTier(tmp_path, 1 << 20)
    assert again.contains_many(keys) == [True] * 10
    assert again.stats().usage_bytes == tier.stats().usage_bytes
    obj = again.get(keys[4])
    assert obj is not None and bytes(obj.payload) == payload_for(keys[4], 3000)
    assert not (tmp_path / "ab" / "stale.kvs.tmp-1234").exists()


def test_a_restart_with_a_smaller_capacity_evicts_down_to_it(tmp_path):
    tier = DiskTier(tmp_path, 1 << 20)
    for i in range(10):
        tier.put(make_key(i), b"y" * 3000, META)
    again = DiskTier(tmp_path, 4 * file_bytes(3000))
    assert again.stats().objects == 4
    assert again.stats().usage_bytes <= 4 * file_bytes(3000)


def corrupt_flip(path: str, at: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(at)
        byte = fh.read(1)
        fh.seek(at)
        fh.write(bytes([byte[0] ^ 0x40]))


def corrupt_truncate(path: str, at: int) -> None:
    os.truncate(path, os.path.getsize(path) - 100)


@pytest.mark.parametrize("damage", [corrupt_flip, corrupt_truncate], ids=["flipped", "truncated"])
@pytest.mark.parametrize("reader", ["get", "read_into"])
def test_a_damaged_disk_object_is_a_counted_miss_and_is_deleted(tmp_path, damage, reader):
    tier = DiskTier(tmp_path, 1 << 20)
    key = make_key(9)
    tier.put(key, payload_for(key, 4096), META)
    path = tier.path_of(key)
    damage(path, os.path.getsize(path) - 1000)  # inside the payload
    if reader == "get":
        assert tier.get(key) is None
    else:
        assert tier.read_into(key, memoryview(bytearray(4096))) is None
    assert tier.stats().corrupt_total == 1
    assert not os.path.exists(path)
    assert tier.contains_many([key]) == [False]


@pytest.mark.parametrize("at", [3, 30, 60])
def test_a_damaged_header_is_dropped_at_restart(tmp_path, at):
    tier = DiskTier(tmp_path, 1 << 20)
    key = make_key(4)
    tier.put(key, payload_for(key, 4096), META)
    corrupt_flip(tier.path_of(key), at)
    again = DiskTier(tmp_path, 1 << 20)
    assert again.contains_many([key]) == [False]
    assert again.stats().corrupt_total == 1
    assert not os.path.exists(tier.path_of(key))


def test_a_file_under_another_keys_name_is_refused(tmp_path):
    tier = DiskTier(tmp_path, 1 << 20)
    a, b = make_key(1), make_key(2)
    tier.put(a, payload_for(a, 100), META)
    os.makedirs(os.path.dirname(tier.path_of(b)), exist_ok=True)
    os.replace(tier.path_of(a), tier.path_of(b))
    again = DiskTier(tmp_path, 1 << 20)
    assert again.contains_many([a, b]) == [False, False]
    assert again.stats().corrupt_total == 1


def test_remove_and_clear_delete_files(tmp_path):
    tier = DiskTier(tmp_path, 1 << 20)
    keys = [make_key(i) for i in range(3)]
    for key in keys:
        tier.put(key, b"z" * 100, META)
    tier.remove(keys[0])
    assert not os.path.exists(tier.path_of(keys[0]))
    tier.clear()
    assert tier.stats().objects == 0 and tier.stats().usage_bytes == 0
    assert not any(files for _, _, files in os.walk(tmp_path))


def test_an_unusable_directory_is_refused_naming_the_field(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match=r"l2\.path"):
        DiskTier(blocker / "l2", 1 << 20)


@pytest.mark.parametrize("codec", ["zstd", "lz4"])
def test_a_compressed_file_found_at_start_is_sized_by_its_payload_not_its_bytes(tmp_path, codec):
    """L1 reserves ``payload_bytes`` for a promotion: for a file another writer
    compressed, that is the decoded length, never the shorter stored one."""
    key = make_key(7)
    payload = b"\0" * 8192  # compresses well: stored length far below 8192
    tier = DiskTier(tmp_path, 1 << 20)
    path = tier.path_of(key)
    tier.close()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(encode_bytes(key, payload, META, codec))
    again = DiskTier(tmp_path, 1 << 20)
    entry = again.peek(key)
    assert entry is not None and entry.payload_bytes == len(payload)
    buf = bytearray(len(payload))
    assert again.read_into(key, memoryview(buf)) == META
    assert bytes(buf) == payload


@pytest.mark.parametrize("codec", ["zstd", "lz4"])
def test_a_damaged_compressed_file_is_a_counted_miss_and_is_deleted(tmp_path, codec):
    """Compressed files take the whole-file path, checked by the hash taken
    while the file was read: a changed stored byte is still caught."""
    key = make_key(8)
    tier = DiskTier(tmp_path, 1 << 20)
    path = tier.path_of(key)
    tier.close()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(encode_bytes(key, b"\0" * 8192, META, codec))
    corrupt_flip(path, os.path.getsize(path) - 2)  # the last stored byte
    again = DiskTier(tmp_path, 1 << 20)
    assert again.peek(key) is not None  # the header is sound
    assert again.get(key) is None
    assert again.stats().corrupt_total == 1
    assert not os.path.exists(path)
