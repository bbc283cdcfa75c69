"""Sealed objects (objformat version 4) and the key folder, without a tier."""

from __future__ import annotations

import os
import struct

import pytest
import xxhash

from kvstrata.sidecar import objformat
from kvstrata.sidecar.objformat import ChunkMeta, SealError, decode, decode_header, encode_bytes
from kvstrata.sidecar.sealing import KeyFolderError, KeyRing, read_key_folder
from kvstrata.testing.keyfolder import MountedSecret, key_files

META = ChunkMeta(dtype="uint8", shape=(4096,))
KEY_A = b"\x01" * 16 + b"\xaa" * 32
KEY_B = b"\x01" * 16 + b"\xbb" * 32


@pytest.fixture
def ring(tmp_path) -> KeyRing:
    MountedSecret(tmp_path).publish(key_files({"k1": os.urandom(32)}, writing="k1"))
    return KeyRing("on", str(tmp_path))


def sealed(ring: KeyRing, key: bytes, data: bytes, tenant: str | None = None) -> bytes:
    return b"".join(bytes(p) for p in objformat.encode(key, data, META, keys=ring, tenant=tenant))


def reforged(blob: bytes, old_key: bytes, new_key: bytes) -> bytes:
    """``blob`` with its header's chunk key replaced and the header checksum
    recomputed: what someone who moves a ciphertext under another name and
    fixes the checksum would write. Only the tag can tell."""
    header = decode_header(blob)
    head = bytearray(blob[: header.header_length])
    at = head.index(old_key)
    head[at : at + len(old_key)] = new_key
    fixed = bytes(head[:48])
    struct.pack_into("<Q", head, 48, xxhash.xxh3_64_intdigest(fixed + bytes(head[56:])))
    return bytes(head) + blob[header.header_length :]


def test_a_ciphertext_moved_under_another_chunk_key_fails_its_tag(ring) -> None:
    data = os.urandom(4096)
    blob = sealed(ring, KEY_A, data)
    assert bytes(decode(blob, KEY_A, keys=ring).payload) == data
    moved = reforged(blob, KEY_A, KEY_B)
    assert decode_header(moved, KEY_B).key == KEY_B  # the header itself is consistent
    with pytest.raises(SealError) as failed:
        decode(moved, KEY_B, keys=ring)
    assert failed.value.reason == "auth_failed"


def test_a_sealed_object_opened_in_place_needs_no_buffer_of_its_own(ring) -> None:
    data = os.urandom(4096)
    blob = bytearray(sealed(ring, KEY_A, data, tenant="team-a"))
    payload = memoryview(decode(blob, KEY_A, keys=ring, in_place=True).payload)
    assert bytes(payload) == data
    header = decode_header(blob)
    # The plaintext is where the ciphertext was: the same buffer, no copy.
    assert blob[header.header_length : header.header_length + len(data)] == data
    assert payload.obj is blob


def test_a_tampered_object_opened_in_place_is_refused(ring) -> None:
    blob = bytearray(sealed(ring, KEY_A, os.urandom(4096)))
    blob[-20] ^= 1
    with pytest.raises(SealError) as failed:
        decode(blob, KEY_A, keys=ring, in_place=True)
    assert failed.value.reason == "auth_failed"


def test_a_tenant_key_is_derived_and_named_in_the_header(ring) -> None:
    data = os.urandom(4096)
    blob = sealed(ring, KEY_A, data, tenant="team-a")
    seal = decode_header(blob).seal
    assert seal is not None and seal.label == "team-a" and seal.key_id == "k1"
    assert bytes(decode(blob, KEY_A, keys=ring).payload) == data
    # Relabelled as another tenant (checksum fixed): the derived key differs, so the tag fails.
    other = reforged(blob, b"team-a", b"team-b")
    with pytest.raises(SealError) as failed:
        decode(other, KEY_A, keys=ring)
    assert failed.value.reason == "auth_failed"


def test_a_chunk_is_sealed_under_its_own_tenants_key(ring) -> None:
    """What the tiers write: the chunk's tenant (kvstrata.sidecar.tenants)
    picks the derived key, no caller has to name it; the default tenant's
    chunks use the KVCache key itself."""
    data = os.urandom(4096)
    tenant_meta = ChunkMeta(dtype="uint8", shape=(4096,), tenant="team-b")
    blob = b"".join(bytes(p) for p in objformat.encode(KEY_A, data, tenant_meta, keys=ring))
    seal = decode_header(blob).seal
    assert seal is not None and seal.label == "team-b"
    assert bytes(decode(blob, KEY_A, keys=ring).payload) == data
    default_seal = decode_header(sealed(ring, KEY_A, data)).seal
    assert default_seal is not None and default_seal.label == ""


def test_a_compressed_payload_is_sealed_after_the_codec(ring) -> None:
    data = bytes(4096)  # compresses to almost nothing
    blob = b"".join(bytes(p) for p in objformat.encode(KEY_A, data, META, "zstd", keys=ring))
    header = decode_header(blob)
    assert header.codec == "zstd" and header.seal is not None and len(blob) < 4096
    assert bytes(decode(blob, KEY_A, keys=ring).payload) == data


def test_off_writes_plaintext_and_refuses_sealed_objects(ring) -> None:
    off = KeyRing("off", None)
    plain = b"".join(bytes(p) for p in objformat.encode(KEY_A, b"x" * 4096, META, keys=off))
    assert decode_header(plain).seal is None
    with pytest.raises(SealError) as failed:
        decode(sealed(ring, KEY_A, b"y" * 4096), KEY_A, keys=off)
    assert failed.value.reason == "no_key"


def test_required_refuses_a_plaintext_object(tmp_path) -> None:
    MountedSecret(tmp_path).publish(key_files({"k1": os.urandom(32)}, writing="k1"))
    strict = KeyRing("required", str(tmp_path))
    with pytest.raises(SealError) as failed:
        decode(encode_bytes(KEY_A, b"z" * 4096, META), KEY_A, keys=strict)
    assert failed.value.reason == "plaintext"


@pytest.mark.parametrize(
    ("files", "named"),
    [
        ({"k1.key": b"short"}, "k1.key: a key is 32 bytes, not 5"),
        ({"K_1.key": bytes(32)}, "key id 'K_1'"),
        ({"k1.key": bytes(32), "k2.key": bytes(32)}, "keyring.json: missing"),
        ({"k1.key": bytes(32), "keyring.json": b'{"writing": "k9"}'}, "writing key 'k9'"),
        ({"k1.key": bytes(32), "keyring.json": b"not json"}, "keyring.json: no 'writing'"),
    ],
)
def test_a_bad_key_folder_is_refused_naming_the_file(tmp_path, files, named) -> None:
    MountedSecret(tmp_path).publish(files)
    with pytest.raises(KeyFolderError) as refused:
        read_key_folder(str(tmp_path))
    assert named in str(refused.value)


def test_required_without_a_folder_or_a_key_refuses(tmp_path) -> None:
    with pytest.raises(KeyFolderError, match=r"encryption\.key_dir"):
        KeyRing("required", None)
    with pytest.raises(KeyFolderError, match="holds no key"):
        KeyRing("required", str(tmp_path))
    assert KeyRing("on", str(tmp_path)).seal_params() is None  # on: plaintext until a key comes


def test_refresh_sees_the_kubelet_swap_and_nothing_else(tmp_path) -> None:
    secret = MountedSecret(tmp_path)
    secret.publish(key_files({"k1": os.urandom(32)}, writing="k1"))
    ring = KeyRing("on", str(tmp_path))
    assert not ring.refresh()
    secret.publish(key_files({"k1": os.urandom(32), "k2": os.urandom(32)}, writing="k2"))
    assert ring.refresh() and ring.writing_key_id == "k2" and ring.reloads_total == 1
    assert not ring.refresh()
