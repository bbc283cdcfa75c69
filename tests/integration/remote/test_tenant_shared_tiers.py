"""A tenant's retention in the shared tiers, on the real servers: Valkey
expires a tenant's keys by its TTL itself; S3, which has no per-object
expiry, gets the moment each object of a TTL tenant expires in its metadata,
and a read past it (a lookup's, a fetch's, a fetch into L1) is a miss that
deletes the object. Neither receives a memory-only tenant's chunks. Objects
are looked at, and aged, with the backends' own clients."""

from __future__ import annotations

import hashlib
import time
from typing import Any

import pytest
import redis

from kvstrata.sidecar.config import SharedConfig, config_from_dict
from kvstrata.sidecar.engine import StorageManager
from kvstrata.sidecar.keys import ChunkKey, key_hex
from kvstrata.sidecar.objformat import ChunkMeta
from kvstrata.sidecar.tiers.factory import build_shared_tier
from kvstrata.sidecar.tiers.s3 import S3Tier
from kvstrata.sidecar.tiers.s3expiry import EXPIRES_KEY, expired
from kvstrata.testing.poll import wait_until

from .conftest import s3_shared_config, valkey_shared_config

CHUNK = 8 << 10
TENANTS = [
    {"name": "daily", "match": {"cache_salts": ["d"]}, "ttl_seconds": 86400},
    {"name": "private", "match": {"cache_salts": ["p"]}, "memory_only": True},
]
TENANTS_AND_DEFAULT = ("daily", "private", "")


def _key(name: str) -> ChunkKey:
    return ChunkKey(b"\x07" * 16 + hashlib.sha256(name.encode()).digest())


def _store_three(shared: SharedConfig, tmp_path: Any) -> dict[str, ChunkKey]:
    """One chunk each of daily, private and the default tenant, written down
    through the engine's write-behind (L2 off)."""
    config = config_from_dict(
        {
            "l1": {"size_bytes": "4Mi", "pin_memory": False},
            "l2": {"enabled": False, "path": str(tmp_path / "l2")},
            "shared": shared.model_dump(),
            "tenants": TENANTS,
        }
    )
    ttls = {t["name"]: t["ttl_seconds"] for t in TENANTS if "ttl_seconds" in t}
    keys = {tenant: _key(f"{shared.backend}/{tmp_path}/{tenant}") for tenant in TENANTS_AND_DEFAULT}
    with StorageManager(config, build_shared_tier(config.shared, ttls)) as engine:
        for tenant, key in keys.items():
            meta = ChunkMeta("uint8", (CHUNK,), tenant=tenant)
            assert engine.put(key, bytes([len(tenant)]) * CHUNK, meta)
        assert engine.flush(timeout=30)
        assert engine.shared is not None
        engine.shared.close()
    return keys


def test_valkey_holds_a_ttl_tenants_chunk_under_its_ttl_and_no_memory_only_chunk(
    valkey_server: Any, tmp_path: Any
) -> None:
    shared = valkey_shared_config(valkey_server.url)
    keys = _store_three(shared, tmp_path)
    server = redis.Redis.from_url(valkey_server.url)
    name = {t: shared.valkey.key_prefix + key_hex(k) for t, k in keys.items()}
    assert 0 < server.pttl(name["daily"]) <= 86400 * 1000
    assert server.pttl(name[""]) == -1  # the default tenant: no expiry (none configured)
    assert not server.exists(name["private"])
    server.close()


def test_s3_holds_a_ttl_tenants_chunk_with_its_expiry_and_no_memory_only_chunk(
    moto_s3: Any, s3_credentials: dict[str, str], moto_s3_raw: Any, tmp_path: Any
) -> None:
    shared = s3_shared_config(moto_s3.endpoint_url, s3_credentials)
    keys = _store_three(shared, tmp_path)
    bucket, prefix = shared.s3.bucket, shared.s3.prefix
    listed = moto_s3_raw.list_objects_v2(Bucket=bucket, Prefix=prefix)
    names = {obj["Key"] for obj in listed.get("Contents", [])}
    assert {prefix + key_hex(keys[t]) for t in ("", "daily")} == names  # not private's
    daily = moto_s3_raw.head_object(Bucket=bucket, Key=prefix + key_hex(keys["daily"]))
    # Its expiry (what it is: tests/unit/sidecar/tiers/test_s3expiry.py), not yet passed.
    assert not expired(daily) and float(daily["Metadata"][EXPIRES_KEY]) > 0
    plain = moto_s3_raw.head_object(Bucket=bucket, Key=prefix + key_hex(keys[""]))
    assert EXPIRES_KEY not in plain["Metadata"]  # the default tenant: no TTL


def _aged(raw: Any, bucket: str, name: str) -> None:
    """The object's expiry moved into the past, as the passing of its TTL would."""
    raw.copy_object(
        Bucket=bucket,
        Key=name,
        CopySource={"Bucket": bucket, "Key": name},
        Metadata={EXPIRES_KEY: f"{time.time() - 1:.3f}"},
        MetadataDirective="REPLACE",
    )


@pytest.mark.parametrize("read", ["lookup", "lookup_ahead", "get", "get_many", "get_into"])
def test_an_s3_object_past_its_tenants_ttl_is_a_miss_and_is_deleted(
    moto_s3: Any, s3_credentials: dict[str, str], moto_s3_raw: Any, read: str
) -> None:
    shared = s3_shared_config(moto_s3.endpoint_url, s3_credentials)
    tier = S3Tier(shared, tenant_ttl_seconds={"daily": 3600.0})
    bucket = shared.s3.bucket
    key, young = _key(f"aged/{read}/{shared.s3.prefix}"), _key(f"young/{shared.s3.prefix}")
    name = shared.s3.prefix + key_hex(key)
    meta = ChunkMeta("uint8", (CHUNK,), tenant="daily")
    assert tier.put(key, b"\x01" * CHUNK, meta) and tier.put(young, b"\x02" * CHUNK, meta)
    assert tier.contains_many([key]) == [True]  # within its TTL: a hit
    _aged(moto_s3_raw, bucket, name)

    if read == "lookup":
        assert tier.contains_many([key, young]) == [False, True]
    elif read == "lookup_ahead":
        assert tier.contains_many_ahead([key]) == [False]
    elif read == "get":
        assert tier.get(key) is None
    elif read == "get_many":
        got = tier.get_many([key, young])
        assert got[0] is None and got[1] is not None and bytes(got[1].payload) == b"\x02" * CHUNK
    else:
        placed: list[int] = []

        def place(nbytes: int, _: ChunkMeta) -> memoryview:
            placed.append(nbytes)
            return memoryview(bytearray(nbytes))

        assert tier.get_into(key, place) is None
        assert placed == []  # nothing was received for it

    assert tier.stats().expired_total == 1

    def gone() -> bool:
        listed = moto_s3_raw.list_objects_v2(Bucket=bucket, Prefix=name)
        return not listed.get("Contents")

    wait_until(gone, 15, "the expired object's deletion")
    assert tier.contains_many([young]) == [True]  # the young one stays
    tier.close()
