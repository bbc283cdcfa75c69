"""A tenant's retention in the shared tiers, on the real servers: Valkey
expires a tenant's keys by its TTL itself; S3, which cannot expire one object
sooner than another, never receives the chunks of a tenant with a TTL, nor
those of a memory-only tenant. Objects are looked at with the backends' own
clients."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
import redis

from kvstrata.sidecar.config import SharedConfig, config_from_dict
from kvstrata.sidecar.engine import StorageManager
from kvstrata.sidecar.keys import ChunkKey, key_hex
from kvstrata.sidecar.objformat import ChunkMeta
from kvstrata.sidecar.tiers.factory import build_shared_tier

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


def test_s3_never_receives_a_ttl_tenants_chunk_nor_a_memory_only_one(
    moto_s3: Any, s3_credentials: dict[str, str], moto_s3_raw: Any, tmp_path: Any
) -> None:
    shared = s3_shared_config(moto_s3.endpoint_url, s3_credentials)
    keys = _store_three(shared, tmp_path)
    listed = moto_s3_raw.list_objects_v2(Bucket=shared.s3.bucket, Prefix=shared.s3.prefix)
    names = {obj["Key"] for obj in listed.get("Contents", [])}
    assert any(key_hex(keys[""]) in n for n in names)  # the default tenant's arrived
    assert not any(key_hex(keys[t]) in n for n in names for t in ("daily", "private"))


@pytest.mark.parametrize("shared_expires", [True, False])
def test_where_a_ttl_tenants_chunks_may_go_depends_on_the_shared_tiers_expiry(
    shared_expires: bool,
) -> None:
    from kvstrata.sidecar.tenant_config import TenantConfig
    from kvstrata.sidecar.tenants import lower_tiers_for

    daily = TenantConfig.model_validate(TENANTS[0])
    expected = {"l2", "shared"} if shared_expires else {"l2"}
    assert lower_tiers_for(daily, shared_expires) == expected
    assert lower_tiers_for(None, shared_expires) == {"l2", "shared"}
