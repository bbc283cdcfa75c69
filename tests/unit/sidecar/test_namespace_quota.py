"""A per-namespace byte budget in L1: a tenant over it evicts its own chunks,
never another tenant's."""

from __future__ import annotations

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
