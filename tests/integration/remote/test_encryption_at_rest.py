"""Encryption at rest, run against every tier below L1 on real servers.

Backends: as the tier contract (Valkey, a Valkey cluster, moto's S3 HTTP
endpoint, the local-disk L2 tier). The raw bytes are read and tampered with
through each backend's own client or file, as an operator reading a dump, a
bad disk or an attacker with write access to the bucket would.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvstrata.bench.kvdata import bf16_kv_like
from kvstrata.sidecar.keys import ChunkKey, Namespace, make_key
from kvstrata.sidecar.objformat import SEALED_FORMAT_VERSION, ChunkMeta, decode_header
from kvstrata.sidecar.sealing import KeyRing
from kvstrata.sidecar.tiers.placing import PLAIN_PAGES_FROM_BYTES
from kvstrata.testing.keyfolder import MountedSecret, key_files

from .conftest import Backend, unique_prefix

NS = Namespace(model="encryption-test").fingerprint()
META = ChunkMeta(dtype="bfloat16", shape=(2, 4, 64))


def random_key() -> ChunkKey:
    return make_key(NS, os.urandom(32))


def payload(seed: int) -> bytes:
    return bf16_kv_like(2 * 4 * 64 * 2, seed=seed)


def ring(folder: Path, mode: str = "on", **keys: bytes) -> KeyRing:
    """A key ring on a mounted folder holding ``keys`` (the last one writes)."""
    secret = MountedSecret(folder)
    secret.publish(key_files(keys, writing=list(keys)[-1]))
    return KeyRing(mode, str(folder))  # type: ignore[arg-type]


def windows(data: bytes, width: int = 32) -> list[bytes]:
    """Every ``width``-byte slice at a stride of ``width``: a plaintext leak of
    any part of the chunk shows up as one of them."""
    return [data[i : i + width] for i in range(0, len(data) - width + 1, width)]


def one_place(backend: Backend, tmp_path: Path) -> dict:
    """Tier settings that put every tier built with them on the same objects
    (another sidecar of the same KVCache, or this one after a restart)."""
    if backend.kind == "disk":
        return {"root": tmp_path / "l2"}
    if backend.kind == "s3":
        return {"s3": {"prefix": unique_prefix().replace(":", "/")}}
    return {"valkey": {"key_prefix": unique_prefix()}}


def get_placed(tier, key: ChunkKey) -> bytes | None:
    """The payload through ``get_into`` (the path a promotion into L1 takes)."""
    out = bytearray(1 << 20)

    def place(nbytes: int, meta: ChunkMeta) -> memoryview:
        return memoryview(out)[:nbytes]

    meta = tier.get_into(key, place)
    return None if meta is None else bytes(out[: len(payload(0))])


def test_stored_object_holds_no_plaintext_of_the_chunk_and_reads_back(backend, tmp_path) -> None:
    keys = ring(tmp_path / "keys", k1=os.urandom(32))
    tier, raw = backend.make_tier(keys=keys)
    key, data = random_key(), payload(1)
    assert tier.put(key, data, META)
    stored = raw.read(raw.name_of(key))
    assert stored is not None
    header = decode_header(stored)
    assert header.seal is not None and header.seal.key_id == "k1"
    assert int.from_bytes(stored[4:6], "little") == SEALED_FORMAT_VERSION
    leaked = [w for w in windows(data) if w in stored]
    assert leaked == []
    got = tier.get(key)
    assert got is not None and bytes(got.payload) == data
    assert get_placed(tier, key) == data
    if backend.kind == "disk":  # what the engine reserves in L1 for it: the plaintext's length
        assert tier.peek(key).payload_bytes == len(data)
    assert tier.stats().decrypt_failures_total == {}


def test_objects_sealed_one_after_another_into_a_reused_buffer_each_read_back(
    backend, tmp_path
) -> None:
    keys = ring(tmp_path / "keys", k1=os.urandom(32))
    tier, _ = backend.make_tier(keys=keys)
    stored = {random_key(): payload(seed) for seed in range(10, 16)}
    for key, data in stored.items():  # one at a time: each seal may reuse the last buffer
        assert tier.put(key, data, META)
    batch = {random_key(): payload(seed) for seed in range(20, 24)}
    assert all(tier.put_many([(k, d, META) for k, d in batch.items()]))
    stored.update(batch)
    if backend.kind == "disk":  # sealed straight into the direct write's buffer: none taken
        assert (keys.buffers.reused_total, keys.buffers.free_bytes) == (0, 0)
    else:
        assert keys.buffers.reused_total >= 5  # each tier gives its ciphertext buffers back
    for key, data in stored.items():
        got = tier.get(key)
        assert got is not None and bytes(got.payload) == data
    assert tier.stats().decrypt_failures_total == {}


def test_each_object_gets_its_own_nonce(backend, tmp_path) -> None:
    tier, raw = backend.make_tier(keys=ring(tmp_path / "keys", k1=os.urandom(32)))
    a, b, data = random_key(), random_key(), payload(2)
    assert tier.put(a, data, META) and tier.put(b, data, META)
    seal_a = decode_header(raw.read(raw.name_of(a))).seal
    seal_b = decode_header(raw.read(raw.name_of(b))).seal
    assert seal_a is not None and seal_b is not None
    assert seal_a.nonce != seal_b.nonce


def test_object_under_a_key_the_reader_lacks_is_a_counted_miss(backend, tmp_path) -> None:
    place = one_place(backend, tmp_path)
    writer, _ = backend.make_tier(keys=ring(tmp_path / "w", k1=os.urandom(32)), **place)
    key, second = random_key(), random_key()
    assert writer.put(key, payload(3), META) and writer.put(second, payload(4), META)
    # Both readers open before either reads, and each reads its own chunk: L2
    # deletes a file it cannot open.
    other_id, _ = backend.make_tier(keys=ring(tmp_path / "r1", k2=os.urandom(32)), **place)
    same_id_other_bytes, _ = backend.make_tier(
        keys=ring(tmp_path / "r2", k1=os.urandom(32)), **place
    )
    assert get_placed(other_id, key) is None
    assert other_id.stats().decrypt_failures_total == {"unknown_key": 1}
    assert get_placed(same_id_other_bytes, second) is None
    stats = same_id_other_bytes.stats()
    assert stats.decrypt_failures_total == {"auth_failed": 1}
    assert stats.errors_total == {} and stats.hits_total == 0


def test_a_tampered_byte_is_a_counted_miss(backend, tmp_path) -> None:
    tier, raw = backend.make_tier(keys=ring(tmp_path / "keys", k1=os.urandom(32)))
    key = random_key()
    assert tier.put(key, payload(4), META)
    name = raw.name_of(key)
    blob = bytearray(raw.read(name))
    blob[len(blob) // 2] ^= 0x01  # a ciphertext byte: the header still parses
    raw.write(name, bytes(blob))
    assert tier.get(key) is None
    assert tier.stats().decrypt_failures_total == {"auth_failed": 1}


@pytest.mark.parametrize("where", ["first byte", "middle", "tag"])
def test_a_tampered_byte_read_into_a_slot_is_a_counted_miss(backend, tmp_path, where) -> None:
    """The sealed payload is opened in its slot as it arrives: the tag still
    refuses it whole, wherever the byte was."""
    tier, raw = backend.make_tier(keys=ring(tmp_path / "keys", k1=os.urandom(32)))
    key = random_key()
    assert tier.put(key, payload(5), META)
    name = raw.name_of(key)
    blob = bytearray(raw.read(name))
    at = {
        "first byte": decode_header(bytes(blob)).header_length,
        "middle": len(blob) // 2,
        "tag": len(blob) - 1,
    }[where]
    blob[at] ^= 0x01
    raw.write(name, bytes(blob))
    assert get_placed(tier, key) is None
    assert tier.stats().decrypt_failures_total == {"auth_failed": 1}


def test_required_never_serves_a_plaintext_object_and_on_reads_it(backend, tmp_path) -> None:
    place = one_place(backend, tmp_path)
    plain_writer, _ = backend.make_tier(**place)
    key, data = random_key(), payload(5)
    assert plain_writer.put(key, data, META)
    material = os.urandom(32)
    migrating, _ = backend.make_tier(keys=ring(tmp_path / "on", k1=material), **place)
    got = migrating.get(key)
    assert got is not None and bytes(got.payload) == data
    strict, _ = backend.make_tier(keys=ring(tmp_path / "req", "required", k1=material), **place)
    assert strict.get(key) is None
    assert get_placed(strict, key) is None
    assert strict.stats().decrypt_failures_total.get("plaintext", 0) >= 1
    assert strict.stats().hits_total == 0


def test_sealed_object_read_with_encryption_off_is_a_counted_miss(backend, tmp_path) -> None:
    place = one_place(backend, tmp_path)
    sealing, _ = backend.make_tier(keys=ring(tmp_path / "keys", k1=os.urandom(32)), **place)
    key = random_key()
    assert sealing.put(key, payload(6), META)
    plain, _ = backend.make_tier(**place)
    assert plain.get(key) is None
    assert plain.stats().decrypt_failures_total == {"no_key": 1}
    if backend.kind != "disk":  # a pod still on "off" in a rollout leaves its peers' objects
        got = sealing.get(key)
        assert got is not None and bytes(got.payload) == payload(6)


def test_rotation_keeps_every_old_object_readable(backend, tmp_path) -> None:
    folder = tmp_path / "keys"
    secret = MountedSecret(folder)
    old, new = os.urandom(32), os.urandom(32)
    secret.publish(key_files({"k1": old}, writing="k1"))
    keys = KeyRing("required", str(folder))
    tier, raw = backend.make_tier(keys=keys)
    before = {random_key(): payload(10 + i) for i in range(4)}
    for key, data in before.items():
        assert tier.put(key, data, META)
    secret.publish(key_files({"k1": old, "k2": new}, writing="k2"))
    assert keys.refresh()
    assert keys.writing_key_id == "k2"
    after = {random_key(): payload(20 + i) for i in range(4)}
    for key, data in after.items():
        assert tier.put(key, data, META)
    for key, data in {**before, **after}.items():
        got = tier.get(key)
        assert got is not None and bytes(got.payload) == data
    seals = {decode_header(raw.read(raw.name_of(k))).seal.key_id for k in after}  # type: ignore[union-attr]
    assert seals == {"k2"}
    stats = tier.stats()
    assert stats.decrypt_failures_total == {}
    assert stats.misses_total == 0


@pytest.mark.parametrize("backend", ["disk"], indirect=True)
def test_a_key_folder_that_stops_parsing_keeps_the_keys_loaded(backend, tmp_path) -> None:
    folder = tmp_path / "keys"
    secret = MountedSecret(folder)
    secret.publish(key_files({"k1": os.urandom(32)}, writing="k1"))
    keys = KeyRing("required", str(folder))
    tier, _ = backend.make_tier(keys=keys)
    key, data = random_key(), payload(7)
    assert tier.put(key, data, META)
    secret.publish({"k1.key": b"short", "keyring.json": b'{"writing": "k1"}'})
    assert not keys.refresh()
    assert keys.reload_failures_total == 1
    got = tier.get(key)
    assert got is not None and bytes(got.payload) == data


def test_a_sealed_object_of_32_mib_reads_back_whole(backend, tmp_path) -> None:
    """Past placing.PLAIN_PAGES_FROM_BYTES a whole read gets a mapping of its
    own, and a sealed object is opened over it."""
    keys = ring(tmp_path / "keys", k1=os.urandom(32))
    tier, _ = backend.make_tier(keys=keys)
    key, data = random_key(), bf16_kv_like(PLAIN_PAGES_FROM_BYTES + 4096, seed=3)
    assert tier.put(key, data, ChunkMeta(dtype="uint8", shape=(len(data),)))
    got = tier.get(key)
    assert got is not None and bytes(got.payload) == data
    assert tier.stats().decrypt_failures_total == {}
