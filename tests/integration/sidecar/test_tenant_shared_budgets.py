"""Per-tenant budgets in the shared tier on a real sidecar process with a real
Valkey, driven by the connector's client over ZeroMQ: a tenant past its
``budgets.shared_bytes`` keeps its chunks in L1, the rest of its shared
copies are refused and counted on /metrics per tenant, and another tenant's
writes are untouched."""

from __future__ import annotations

from typing import Any

import redis

from kvstrata.sidecar.keys import key_hex

CHUNK = 64 << 10
# A Valkey object is the chunk plus a header and trailer of well under 8 KiB:
# four fit in 288 KiB, five do not.
TEAM_A = {
    "name": "team-a",
    "match": {"cache_salts": ["a"]},
    "budgets": {"shared_bytes": "288Ki"},
}
TEAM_B = {"name": "team-b", "match": {"cache_salts": ["b"]}, "budgets": {"shared_bytes": "2Mi"}}


def test_a_tenant_past_its_shared_budget_is_refused_there_counted_and_still_served_from_l1(
    sidecar_factory: Any, kit: Any, valkey: Any
) -> None:
    shared = kit.shared_valkey(valkey.url)
    shared["valkey"]["ttl_seconds"] = 3600
    sidecar = sidecar_factory(
        overrides={"shared": shared, "l2": {"enabled": False}, "tenants": [TEAM_A, TEAM_B]}
    ).start()
    prefix = shared["valkey"]["key_prefix"]
    server = redis.Redis.from_url(valkey.url)
    client = sidecar.client()
    team_a, team_b = kit.make_keys(10, seed=900), kit.make_keys(8, seed=901)
    assert kit.store(client, team_a, CHUNK, owner="a", tenant="team-a") == 10
    assert kit.store(client, team_b, CHUNK, owner="b", tenant="team-b") == 8

    def refused(tenant: str) -> float:
        labels = {"reason": "budget", "tenant": tenant, "tier": "shared"}
        return sidecar.metric("kvstrata_tenant_refusals_total", 0.0, **labels)

    def in_valkey(keys: list[Any]) -> list[bool]:
        return [bool(server.exists(prefix + key_hex(k))) for k in keys]

    kit.wait_until(
        lambda: (
            sidecar.metric("kvstrata_writeback_pinned_bytes", 0.0) == 0
            and all(in_valkey(team_b))
            and refused("team-a") == 6
        ),
        30,
        "the write-behind of both tenants' chunks",
    )
    # Four of team-a's ten fit its budget, whichever writer threads won.
    assert sum(in_valkey(team_a)) == 4
    assert refused("team-b") == 0
    # A refused shared copy is not an error: every chunk is still served from L1.
    assert kit.retrieve(client, team_a, owner="ra") == [kit.payload(k, CHUNK) for k in team_a]
    errors = [
        line
        for line in sidecar.get("/metrics").splitlines()
        if line.startswith("kvstrata_tier_errors_total{") and 'tier="valkey"' in line
    ]
    assert all(line.endswith(" 0.0") for line in errors), errors
    client.close()
    server.close()
