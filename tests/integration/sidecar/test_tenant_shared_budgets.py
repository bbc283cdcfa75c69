"""Per-tenant budgets in the shared tier on two real sidecar processes (two
pods of one cache) and a real Valkey, driven by the connector's client over
ZeroMQ: a tenant's ``budgets.shared_bytes`` holds for both pods together,
its chunks past it stay in L1, its refused shared copies are counted on
/metrics per tenant, and another tenant's writes are untouched."""

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


def test_two_sidecars_hold_a_tenant_to_one_shared_budget_counted_and_still_served_from_l1(
    sidecar_factory: Any, kit: Any, valkey: Any
) -> None:
    shared = kit.shared_valkey(valkey.url)  # one key prefix: one cache, two pods
    shared["valkey"]["ttl_seconds"] = 3600
    overrides = {"shared": shared, "l2": {"enabled": False}, "tenants": [TEAM_A, TEAM_B]}
    pods = [sidecar_factory(name, overrides=overrides).start() for name in ("pod-0", "pod-1")]
    prefix = shared["valkey"]["key_prefix"]
    server = redis.Redis.from_url(valkey.url)
    clients = [pod.client() for pod in pods]
    team_a = [kit.make_keys(5, seed=900), kit.make_keys(5, seed=901)]  # five from each pod
    team_b = kit.make_keys(8, seed=902)
    for client, keys in zip(clients, team_a, strict=True):
        assert kit.store(client, keys, CHUNK, owner="a", tenant="team-a") == 5
    assert kit.store(clients[0], team_b, CHUNK, owner="b", tenant="team-b") == 8

    def refused(tenant: str) -> float:
        labels = {"reason": "budget", "tenant": tenant, "tier": "shared"}
        return sum(pod.metric("kvstrata_tenant_refusals_total", 0.0, **labels) for pod in pods)

    def in_valkey(keys: list[Any]) -> list[bool]:
        return [bool(server.exists(prefix + key_hex(k))) for k in keys]

    kit.wait_until(
        lambda: (
            all(pod.metric("kvstrata_writeback_pinned_bytes", 0.0) == 0 for pod in pods)
            and all(in_valkey(team_b))
            and refused("team-a") == 6
        ),
        30,
        "the write-behind of both pods",
    )
    # Four of team-a's ten fit its budget, whichever pod and writer thread won.
    assert sum(in_valkey(team_a[0] + team_a[1])) == 4
    assert refused("team-b") == 0
    # Each pod shows what the one ledger counts: team-a's four objects.
    held = [
        pod.metric("kvstrata_tenant_bytes", 0.0, tenant="team-a", tier="shared") for pod in pods
    ]
    assert held[0] == held[1] and 4 * CHUNK < held[0] <= 288 << 10
    assert pods[0].metric("kvstrata_tenant_bytes", -1.0, tenant="default", tier="shared") == -1.0
    # A refused shared copy is not an error: every chunk is still served from L1.
    for client, keys in zip(clients, team_a, strict=True):
        assert kit.retrieve(client, keys, owner="r") == [kit.payload(k, CHUNK) for k in keys]
    for pod in pods:
        errors = [
            line
            for line in pod.get("/metrics").splitlines()
            if line.startswith("kvstrata_tier_errors_total{") and 'tier="valkey"' in line
        ]
        assert all(line.endswith(" 0.0") for line in errors), errors
    for client in clients:
        client.close()
    server.close()
