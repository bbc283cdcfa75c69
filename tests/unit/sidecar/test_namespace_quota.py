"""A per-namespace byte budget in L1: a tenant over it evicts its own chunks,
never another tenant's."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from kvstrata.sidecar.keys import ChunkKey, Namespace
from kvstrata.sidecar.objformat import ChunkMeta

CHUNK = 256 << 10
META = ChunkMeta(dtype="uint8", shape=(CHUNK,))


def _keys(tenant: str, n: int) -> list[ChunkKey]:
    fp = Namespace(model="m", cache_salt=tenant).fingerprint()
    return [ChunkKey(fp + i.to_bytes(32, "big")) for i in range(n)]


def test_a_tenant_over_its_l1_quota_evicts_its_own_chunks_and_nobody_elses(make_engine: Any):
    engine = make_engine(
        l1={"size_bytes": "8Mi", "namespace_quota_bytes": "2Mi"}, l2={"enabled": False}
    )
    quiet, busy = _keys("quiet", 4), _keys("busy", 24)  # 1 MiB, then 6 MiB
    for key in quiet + busy:
        assert engine.put(key, b"\x01" * CHUNK, META)
    assert engine.lookup(quiet).hit_chunks == len(quiet)
    held = sum(engine.lookup([k]).tiers == ["l1"] for k in busy)
    assert held == 8  # 2 MiB of 256 KiB chunks: the newest of them
    assert engine.lookup(busy[-8:]).tiers == ["l1"] * 8


def test_a_chunk_larger_than_the_quota_is_refused(make_engine: Any):
    engine = make_engine(
        l1={"size_bytes": "8Mi", "namespace_quota_bytes": "128Ki"}, l2={"enabled": False}
    )
    assert not engine.put(_keys("t", 1)[0], b"\x01" * CHUNK, META)


def test_a_tenant_over_its_l2_quota_evicts_its_own_files_and_nobody_elses(tmp_path: Any):
    from kvstrata.sidecar.tiers.disk import DiskTier

    tier = DiskTier(tmp_path / "l2", 64 << 20, namespace_quota=2 << 20)
    quiet, busy = _keys("quiet", 4), _keys("busy", 24)
    for key in quiet + busy:
        assert tier.put(key, b"\x02" * CHUNK, META)
    assert tier.contains_many(quiet) == [True] * 4
    held = tier.contains_many(busy)
    assert 6 <= sum(held) < 8  # 2 MiB less the files' headers
    assert all(held[-6:]) and not any(held[:16])
    tier.close()


def test_the_l2_quota_never_evicts_a_pinned_tenants_files_for_another_tenant(tmp_path: Any):
    # Tenants named by their Kubernetes namespace share the model's key namespace:
    # the quota counts both, and a pinned tenant's files stay (tenant budgets'
    # promise): the other tenant's stores evict its own older files instead.
    from kvstrata.sidecar.tiers.disk import DiskTier
    from kvstrata.sidecar.tiers.tenant_shares import TenantShares

    shares = TenantShares(budgets={"team-a": 4 << 20}, pinned=["team-a"], known=["team-b"])
    tier = DiskTier(tmp_path / "l2", 64 << 20, namespace_quota=2 << 20, tenants=shares)
    same_namespace = _keys("shared-model", 12)
    pinned, other = same_namespace[:4], same_namespace[4:]
    for key in pinned:  # 1 MiB of team-a's, oldest in the LRU order
        assert tier.put(key, b"\x03" * CHUNK, replace(META, tenant="team-a"))
    for key in other:  # 2 MiB of team-b's
        assert tier.put(key, b"\x04" * CHUNK, replace(META, tenant="team-b"))
    assert tier.contains_many(pinned) == [True] * 4
    held = tier.contains_many(other)
    assert held[-3:] == [True] * 3 and not any(held[:4])  # team-b's newest, under the quota
    tier.close()


def test_a_store_the_quota_cannot_fit_beside_pinned_files_is_refused(tmp_path: Any):
    from kvstrata.sidecar.tiers.disk import DiskTier
    from kvstrata.sidecar.tiers.tenant_shares import TenantShares

    shares = TenantShares(budgets={"team-a": 4 << 20}, pinned=["team-a"], known=["team-b"])
    tier = DiskTier(tmp_path / "l2", 64 << 20, namespace_quota=1 << 20, tenants=shares)
    pinned, (late,) = _keys("shared-model", 3)[:3], _keys("shared-model", 4)[3:]
    for key in pinned:
        assert tier.put(key, b"\x03" * CHUNK, replace(META, tenant="team-a"))
    assert not tier.put(late, b"\x04" * 2 * CHUNK, replace(META, tenant="team-b"))
    assert tier.contains_many([*pinned, late]) == [True, True, True, False]
    tier.close()
