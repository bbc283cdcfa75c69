"""Encryption at rest in real sidecar processes: ciphertext in L2 files and
Valkey values, a key rotation while serving (through the kubelet's symlink
swap of the mounted Secret) that costs no miss, and ``required`` without a
key refusing to start."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import redis

from kvstrata.sidecar.objformat import decode_header
from kvstrata.testing.keyfolder import MountedSecret, key_files

NBYTES = 4096


def l2_files(sidecar: Any) -> dict[str, bytes]:
    """Every chunk file of the sidecar's L2, by key hex."""
    root = sidecar.root / "l2"
    return {p.name[: -len(".kvs")]: p.read_bytes() for p in root.glob("*/*.kvs")}


def valkey_values(server: Any, prefix: str) -> dict[str, bytes]:
    client = redis.Redis(host="127.0.0.1", port=server.port)
    try:
        return {
            name.decode()[len(prefix) :]: client.get(name)
            for name in client.scan_iter(match=f"{prefix}*")
        }
    finally:
        client.close()


def assert_sealed_without_plaintext(objects: dict[str, bytes], kit: Any, key_id: str) -> None:
    for hexkey, blob in objects.items():
        header = decode_header(blob)
        assert header.seal is not None and header.seal.key_id == key_id, hexkey
        plain = kit.payload(header.key, NBYTES)
        leaks = [plain[i : i + 32] for i in range(0, NBYTES, 32) if plain[i : i + 32] in blob]
        assert leaks == [], f"{hexkey}: plaintext of the chunk in the stored object"


def test_rotation_while_serving_keeps_every_chunk_a_hit_and_nothing_in_plaintext(
    sidecar_factory: Any, kit: Any, valkey: Any, tmp_path: Path
) -> None:
    secret = MountedSecret(tmp_path / "keys")
    old, new = os.urandom(32), os.urandom(32)
    secret.publish(key_files({"k1": old}, writing="k1"))
    shared = kit.shared_valkey(valkey.url)
    prefix = shared["valkey"]["key_prefix"]
    encryption = {"mode": "required", "key_dir": str(tmp_path / "keys"), "reload_seconds": 0.05}
    a = sidecar_factory("a", {"shared": shared, "encryption": encryption}).start()
    writer = a.client()
    before = kit.make_keys(6, seed=40)
    assert kit.store(writer, before, NBYTES, owner="w") == 6
    kit.wait_until(lambda: len(l2_files(a)) == 6, 15, "write-behind into L2")
    kit.wait_until(lambda: len(valkey_values(valkey, prefix)) == 6, 15, "into Valkey")
    assert_sealed_without_plaintext(l2_files(a), kit, "k1")
    assert_sealed_without_plaintext(valkey_values(valkey, prefix), kit, "k1")

    # The kubelet's swap of the Secret volume: k2 writes, k1 stays for reading.
    secret.publish(key_files({"k1": old, "k2": new}, writing="k2"))
    kit.wait_until(
        lambda: a.metric("kvstrata_encryption_key_reloads_total", 0.0) >= 1, 15, "the key reload"
    )
    assert a.metric("kvstrata_encryption_keys", 0.0) == 2
    after = kit.make_keys(6, seed=41)
    assert kit.store(writer, after, NBYTES, owner="w") == 6
    kit.wait_until(lambda: len(l2_files(a)) == 12, 15, "write-behind into L2")
    kit.wait_until(lambda: len(valkey_values(valkey, prefix)) == 12, 15, "into Valkey")
    new_files = {k: v for k, v in l2_files(a).items() if decode_header(v).key in after}
    assert_sealed_without_plaintext(new_files, kit, "k2")

    # Another pod of the same KVCache (same Secret) reads both generations from Valkey.
    b = sidecar_factory("b", {"shared": shared, "encryption": encryption}).start()
    reader = b.client()
    everything = before + after
    reply = reader.lookup(everything, prefetch=False, owner="r")
    assert reply is not None and reply.hit_chunks == 12
    assert kit.retrieve(reader, everything, owner="r") == [
        kit.payload(k, NBYTES) for k in everything
    ]
    # The writer restarted: L1 is empty, both generations come back from L2.
    writer.close()
    a.stop()
    a.start()
    writer = a.client()
    reply = writer.lookup(everything, prefetch=False, owner="w")
    assert reply is not None and reply.hit_chunks == 12 and set(reply.tiers) == {"l2"}
    assert kit.retrieve(writer, everything, owner="w") == [
        kit.payload(k, NBYTES) for k in everything
    ]
    for sidecar in (a, b):
        assert sidecar.metric("kvstrata_decrypt_failures_total", 0.0) == 0
    writer.close()
    reader.close()
    a.stop()
    b.stop()


def test_a_sidecar_with_another_key_misses_instead_of_failing(
    sidecar_factory: Any, kit: Any, valkey: Any, tmp_path: Path
) -> None:
    shared = kit.shared_valkey(valkey.url)
    MountedSecret(tmp_path / "ours").publish(key_files({"k1": os.urandom(32)}, writing="k1"))
    MountedSecret(tmp_path / "wrong").publish(key_files({"k1": os.urandom(32)}, writing="k1"))
    ours = {"mode": "required", "key_dir": str(tmp_path / "ours")}
    wrong = {"mode": "required", "key_dir": str(tmp_path / "wrong")}
    a = sidecar_factory("a", {"shared": shared, "encryption": ours}).start()
    b = sidecar_factory("b", {"shared": shared, "encryption": wrong}).start()
    writer, reader = a.client(), b.client()
    keys = kit.make_keys(3, seed=42)
    assert kit.store(writer, keys, NBYTES, owner="w") == 3
    prefix = shared["valkey"]["key_prefix"]
    kit.wait_until(lambda: len(valkey_values(valkey, prefix)) == 3, 15, "into Valkey")
    reply = reader.lookup(keys, prefetch=False, owner="r")
    assert reply is not None and reply.hit_chunks == 3  # present: only opening tells
    assert kit.retrieve(reader, keys, owner="r") == [None, None, None]
    refused = b.metric("kvstrata_decrypt_failures_total", 0.0, tier="valkey", reason="auth_failed")
    assert refused >= 1
    # Still serving: its own chunks are stored and read back.
    own = kit.make_keys(2, seed=43)
    assert kit.store(reader, own, NBYTES, owner="r") == 2
    assert kit.retrieve(reader, own, owner="r") == [kit.payload(k, NBYTES) for k in own]
    writer.close()
    reader.close()
    a.stop()
    b.stop()


def test_required_without_a_key_refuses_to_start_naming_the_field(
    sidecar_factory: Any, tmp_path: Path
) -> None:
    empty = tmp_path / "no-keys"
    empty.mkdir()
    encryption = {"mode": "required", "key_dir": str(empty)}
    sidecar = sidecar_factory("nokey", {"encryption": encryption})
    with pytest.raises(AssertionError):
        sidecar.start()
    assert "encryption.key_dir" in sidecar.log()
