"""Per-tenant L2 budgets on a real sidecar process with a real Valkey shared
tier, driven by the connector's client over ZeroMQ: a budgeted tenant evicts
its own L2 files, a pinned one is refused at its budget and survives another
tenant's flood of the disk, and the counts are on /metrics per tenant."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from kvstrata.sidecar.keys import ChunkKey, key_hex

CHUNK = 64 << 10
BATCH = 16
# Budgets count file bytes (header + payload, 65,651 bytes a chunk here): 16
# files fit 1035 KiB and 17 do not; 32 fit 2060 KiB and 33 do not.
TEAM_A = {
    "name": "team-a",
    "match": {"cache_salts": ["a"]},
    "budgets": {"l1_bytes": "2Mi", "l2_bytes": "1035Ki"},
    "pinned": True,
}
TEAM_B = {"name": "team-b", "match": {"cache_salts": ["b"]}, "budgets": {"l2_bytes": "2060Ki"}}


def metric(sidecar: Any, name: str, labels: str) -> float:
    found = re.search(rf"^{name}{re.escape(labels)} (\S+)$", sidecar.get("/metrics"), re.M)
    return float(found.group(1)) if found else 0.0


def store_all(kit: Any, client: Any, keys: list[ChunkKey], tenant: str = "") -> int:
    return sum(
        kit.store(client, keys[i : i + BATCH], CHUNK, owner=f"s{i}-{tenant}", tenant=tenant)
        for i in range(0, len(keys), BATCH)
    )


def test_l2_budgets_per_tenant_evict_their_own_refuse_the_pinned_and_keep_it_in_a_flood(
    sidecar_factory: Any, kit: Any, valkey: Any
) -> None:
    sidecar = sidecar_factory(
        overrides={
            "shared": kit.shared_valkey(valkey.url),
            # One writer and a queue deep enough for every chunk here: L2 writes
            # land in store order and none is dropped, so "the oldest" files are
            # the first stored. (With two writers or a full queue, as on a loaded
            # machine, a later chunk's file can land first and be evicted in its
            # place: write-behind is best effort, not in order.)
            "l2": {"size_bytes": "5Mi", "writer_threads": 1, "write_queue_depth": 256},
            "tenants": [TEAM_A, TEAM_B],
        }
    ).start()
    l2_dir = Path(sidecar.config_path).parent / "l2"
    client = sidecar.client()

    def files() -> set[str]:
        return {p.name.split(".")[0] for p in l2_dir.glob("*/*.kvs")}

    def settled() -> bool:
        return metric(sidecar, "kvstrata_writeback_pinned_bytes", "") == 0

    def l2(label: str, tenant: str) -> float:
        return metric(sidecar, label, f'{{tenant="{tenant}",tier="l2"}}')

    team_a, extra_a = kit.make_keys(16, seed=800), kit.make_keys(2, seed=801)
    team_b, flood = kit.make_keys(48, seed=802), kit.make_keys(96, seed=803)

    assert store_all(kit, client, team_a, tenant="team-a") == 16
    kit.wait_until(lambda: {key_hex(k) for k in team_a} <= files(), 30, "team-a in L2")
    # team-a at its L2 budget is pinned: the next two stores reach L1, not L2.
    assert store_all(kit, client, extra_a, tenant="team-a") == 2
    refused = '{reason="pinned_budget",tenant="team-a",tier="l2"}'
    kit.wait_until(
        lambda: metric(sidecar, "kvstrata_tenant_refusals_total", refused) == 2 and settled(),
        30,
        "team-a's two L2 refusals",
    )
    assert not {key_hex(k) for k in extra_a} & files()
    team_a_bytes = l2("kvstrata_tenant_bytes", "team-a")
    assert 16 * CHUNK < team_a_bytes <= 1035 << 10

    # team-b stores 48 chunks into a budget of 32: its 16 oldest files go.
    assert store_all(kit, client, team_b, tenant="team-b") == 48
    oldest = {key_hex(k) for k in team_b[:16]}
    # An eviction is counted when the index drops the file; its unlink follows
    # outside the tier's lock: the files are awaited, not assumed gone.
    kit.wait_until(
        lambda: (
            l2("kvstrata_tenant_evictions_total", "team-b") == 16
            and settled()
            and not oldest & files()
        ),
        30,
        "team-b evicting its own 16 oldest L2 files",
    )
    on_disk = files()
    assert {key_hex(k) for k in team_b[16:]} <= on_disk
    assert l2("kvstrata_tenant_bytes", "team-b") <= 2060 << 10

    # The default tenant floods the 5 MiB disk: team-b's files are evicted,
    # pinned team-a's all stay.
    assert store_all(kit, client, flood) == 96
    kit.wait_until(
        lambda: l2("kvstrata_tenant_bytes", "team-b") == 0 and settled(),
        60,
        "the flood evicting team-b's files",
    )
    assert {key_hex(k) for k in team_a} <= files()
    assert l2("kvstrata_tenant_bytes", "team-a") == team_a_bytes
    assert l2("kvstrata_tenant_evictions_total", "team-a") == 0
    assert metric(sidecar, "kvstrata_tenant_refusals_total", refused) == 2
    client.close()
