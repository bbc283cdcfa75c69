"""Per-tenant retention on a real sidecar process, driven by the connector's
client over ZeroMQ: budgets, pinning, memory-only tenants, the shared tier's
per-key expiry, and stores that name a tenant the sidecar does not know."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import redis

from kvstrata.sidecar import protocol as p
from kvstrata.sidecar.keys import ChunkKey, key_hex
from kvstrata.testing.rawpeer import RawPeer

CHUNK = 64 << 10  # 16 of them are 1 MiB
BATCH = 16  # stores per PREPARE_STORE: well inside a session's write budget

TEAM_A = {  # pinned: what it stored within 1 MiB stays, whoever floods L1
    "name": "team-a",
    "match": {"cache_salts": ["a"]},
    "budgets": {"l1_bytes": "1Mi"},
    "pinned": True,
}
TEAM_B = {
    "name": "team-b",
    "match": {"cache_salt_prefixes": ["b-"]},
    "budgets": {"l1_bytes": "2Mi"},
}
ELSEWHERE = {"name": "elsewhere", "match": {"models": ["another-model"]}}


def store_all(kit: Any, client: Any, keys: list[ChunkKey], tenant: str = "") -> int:
    return sum(
        kit.store(client, keys[i : i + BATCH], CHUNK, owner=f"s{i}", tenant=tenant)
        for i in range(0, len(keys), BATCH)
    )


def held(kit: Any, client: Any, key: ChunkKey) -> bool:
    return kit.retrieve(client, [key], owner="probe") == [kit.payload(key, CHUNK)]


def test_a_pinned_tenant_survives_a_flood_and_a_budgeted_one_evicts_its_own_chunks(
    sidecar_factory: Any, kit: Any
) -> None:
    sidecar = sidecar_factory(
        overrides={"l2": {"enabled": False}, "tenants": [TEAM_A, TEAM_B, ELSEWHERE]}
    ).start()
    client = sidecar.client()
    team_a, team_b = kit.make_keys(16, seed=700), kit.make_keys(96, seed=701)
    flood = kit.make_keys(320, seed=702)  # 20 MiB into a 16 MiB arena

    assert store_all(kit, client, team_a, tenant="team-a") == 16
    assert sorted(t.name for t in client.tenants) == ["team-a", "team-b"]  # not elsewhere's
    assert store_all(kit, client, team_b, tenant="team-b") == 96
    # team-b over its 2 MiB evicted its own oldest chunks, nobody else's.
    assert sidecar.metric("kvstrata_tenant_evictions_total", 0.0, tenant="team-b", tier="l1") == 64
    assert [held(kit, client, k) for k in team_b[:64]] == [False] * 64
    assert kit.retrieve(client, team_b[64:], owner="b") == [
        kit.payload(k, CHUNK) for k in team_b[64:]
    ]
    assert sidecar.metric("kvstrata_tenant_bytes", 0.0, tenant="team-b", tier="l1") == 2 << 20

    assert store_all(kit, client, flood) == 320
    assert sidecar.metric("kvstrata_tenant_evictions_total", 0.0, tenant="default", tier="l1") > 0
    # The flood evicted everything of team-b, nothing of pinned team-a.
    assert sidecar.metric("kvstrata_tenant_bytes", 0.0, tenant="team-b", tier="l1") == 0
    assert kit.retrieve(client, team_a, owner="a") == [kit.payload(k, CHUNK) for k in team_a]
    assert sidecar.metric("kvstrata_tenant_bytes", 0.0, tenant="team-a", tier="l1") == 1 << 20
    assert sidecar.metric("kvstrata_tenant_evictions_total", 0.0, tenant="team-a", tier="l1") == 0

    # A pinned tenant at its budget is refused, counted, and keeps what it has.
    extra = kit.make_keys(2, seed=703)
    assert kit.store(client, extra, CHUNK, owner="x", tenant="team-a") == 0
    refused = {"reason": "pinned_budget", "tenant": "team-a", "tier": "l1"}
    assert sidecar.metric("kvstrata_tenant_refusals_total", 0.0, **refused) == 2
    assert kit.retrieve(client, team_a, owner="a2") == [kit.payload(k, CHUNK) for k in team_a]
    client.close()


def test_a_store_naming_an_unknown_tenant_is_refused_naming_it_and_the_sidecar_keeps_serving(
    sidecar_factory: Any, kit: Any
) -> None:
    sidecar = sidecar_factory(overrides={"tenants": [TEAM_A, ELSEWHERE]}).start()
    peer = RawPeer(sidecar.endpoint)
    peer.hello(kit.NAMESPACE.fingerprint(), namespace={"model": kit.NAMESPACE.model})
    key = kit.make_keys(1, seed=710)[0]
    body = {"keys": [key], "nbytes": CHUNK, "dtype": "uint8", "shape": [CHUNK], "owner": "o"}
    for tenant, named in (
        ("nobody", "unknown tenant 'nobody'"),
        ("elsewhere", "not on this session's model"),
    ):
        reply = peer.call(p.PREPARE_STORE, {**body, "tenant": tenant})
        assert reply[2] is False and reply[3]["code"] == p.E_BAD_REQUEST
        assert "field 'tenant'" in reply[3]["message"]
        assert named in reply[3]["message"]
    assert (
        "known: elsewhere, team-a"
        in peer.call(p.PREPARE_STORE, {**body, "tenant": "x"})[3]["message"]
    )
    peer.close()
    assert sidecar.metric("kvstrata_errors_total", 0.0, kind="unknown_tenant") == 3
    # Tenant labels are the config's names only: nothing a client sent.
    assert "nobody" not in sidecar.get("/metrics")
    client = sidecar.client()
    assert kit.store(client, [key], CHUNK, owner="w", tenant="team-a") == 1
    assert kit.retrieve(client, [key], owner="r") == [kit.payload(key, CHUNK)]
    client.close()


def test_a_memory_only_tenant_leaves_no_l2_file_and_no_valkey_key_and_a_ttl_is_the_keys_expiry(
    sidecar_factory: Any, kit: Any, valkey: Any
) -> None:
    tenants = [
        {"name": "private", "match": {"cache_salts": ["p"]}, "memory_only": True},
        {"name": "daily", "match": {"cache_salts": ["d"]}, "ttl_seconds": 3600},
        {"name": "no-disk", "match": {"cache_salts": ["n"]}, "budgets": {"l2_bytes": 0}},
    ]
    shared = kit.shared_valkey(valkey.url)
    sidecar = sidecar_factory(overrides={"shared": shared, "tenants": tenants}).start()
    prefix = shared["valkey"]["key_prefix"]
    server = redis.Redis.from_url(valkey.url)
    l2_dir = Path(sidecar.config_path).parent / "l2"
    client = sidecar.client()
    private, daily = kit.make_keys(4, seed=720), kit.make_keys(4, seed=721)
    no_disk, plain = kit.make_keys(4, seed=722), kit.make_keys(4, seed=723)
    assert kit.store(client, private, CHUNK, owner="p", tenant="private") == 4
    assert kit.store(client, daily, CHUNK, owner="d", tenant="daily") == 4
    assert kit.store(client, no_disk, CHUNK, owner="n", tenant="no-disk") == 4
    assert kit.store(client, plain, CHUNK, owner="o") == 4

    def on_disk(key: ChunkKey) -> bool:
        return any(l2_dir.glob(f"*/{key_hex(key)}*"))

    def written() -> bool:
        in_valkey = all(server.exists(prefix + key_hex(k)) for k in plain + daily + no_disk)
        in_l2 = all(on_disk(k) for k in plain + daily)
        idle = sidecar.metric("kvstrata_writeback_pinned_bytes", 0.0) == 0
        return in_valkey and in_l2 and idle

    kit.wait_until(written, 30, "the write-behind of the other tenants' chunks")
    assert not any(on_disk(k) for k in private + no_disk)
    assert not any(server.exists(prefix + key_hex(k)) for k in private)
    # Valkey expires the daily tenant's keys itself (SET ... PX); others keep none.
    for key in daily:
        assert 0 < server.pttl(prefix + key_hex(key)) <= 3600 * 1000
    assert all(server.pttl(prefix + key_hex(k)) == -1 for k in plain + no_disk)
    # Memory-only chunks are still served from L1.
    assert kit.retrieve(client, private, owner="r") == [kit.payload(k, CHUNK) for k in private]
    client.close()
    server.close()
