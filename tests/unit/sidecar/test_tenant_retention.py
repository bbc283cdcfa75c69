"""Tenants in the engine: a TTL ages chunks out of L1 and L2 (by a clock the
test moves, never by sleeping), budgets of 0 keep nothing, and the config
refuses tenants it could not honour, naming them."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstrata.sidecar.config import ConfigError, config_from_dict
from kvstrata.sidecar.engine import StorageManager
from kvstrata.sidecar.objformat import ChunkMeta
from kvstrata.sidecar.tenant_config import TenantConfig
from kvstrata.sidecar.tenants import lower_tiers_for

from ..conftest import make_key, payload_for

CHUNK = 16 << 10


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _engine(tmp_path: Path, clock: Clock, *tenants: dict[str, object]) -> StorageManager:
    config = config_from_dict(
        {
            "l1": {"size_bytes": "2Mi", "pin_memory": False},
            "l2": {"path": str(tmp_path / "l2"), "size_bytes": "8Mi"},
            "tenants": list(tenants),
        }
    )
    return StorageManager(config, clock=clock)


def _meta(tenant: str = "") -> ChunkMeta:
    return ChunkMeta("uint8", (CHUNK,), tenant=tenant)


def test_a_chunk_older_than_its_tenants_ttl_is_a_miss_in_l1_and_l2_and_is_removed(
    tmp_path: Path,
) -> None:
    clock = Clock()
    daily = {"name": "daily", "match": {"cache_salts": ["d"]}, "ttl_seconds": 60}
    with _engine(tmp_path, clock, daily) as engine:
        aged, kept = make_key(1), make_key(2)
        assert engine.put(aged, payload_for(aged, CHUNK), _meta("daily"))
        assert engine.put(kept, payload_for(kept, CHUNK), _meta())
        assert engine.flush(timeout=30)
        assert engine.l2 is not None and engine.l2.contains(aged) and engine.l2.contains(kept)

        clock.now += 59.0
        assert engine.lookup([aged]).tiers == ["l1"]
        clock.now += 1.0
        assert engine.lookup([aged]).hit_chunks == 0  # neither L1 nor L2 answers it
        assert not engine.l2.contains(aged)
        assert engine.get(aged) is None
        assert engine.get(kept) == payload_for(kept, CHUNK)  # the default tenant has no TTL
        expired = engine.stats().tenants.expirations
        assert expired == {("daily", "l1"): 1, ("daily", "l2"): 1}


def test_storing_a_chunk_again_restarts_its_age(tmp_path: Path) -> None:
    clock = Clock()
    daily = {"name": "daily", "match": {"cache_salts": ["d"]}, "ttl_seconds": 60}
    with _engine(tmp_path, clock, daily) as engine:
        key = make_key(3)
        engine.put(key, payload_for(key, CHUNK), _meta("daily"))
        clock.now += 50.0
        engine.remove(key)
        assert engine.put(key, payload_for(key, CHUNK), _meta("daily"))
        clock.now += 50.0  # 100 s after the first store, 50 s after the second
        assert engine.get(key) == payload_for(key, CHUNK)


def test_an_l1_budget_of_zero_keeps_nothing_and_counts_why(tmp_path: Path) -> None:
    never = {"name": "never", "match": {"cache_salts": ["n"]}, "budgets": {"l1_bytes": 0}}
    with _engine(tmp_path, Clock(), never) as engine:
        key = make_key(4)
        assert not engine.put(key, payload_for(key, CHUNK), _meta("never"))
        assert engine.lookup([key]).hit_chunks == 0
        assert engine.stats().tenants.refusals == {("never", "l1", "not_kept"): 1}


def test_where_a_tenants_chunks_may_go_below_l1() -> None:
    def tenant(**fields: object) -> TenantConfig:
        return TenantConfig.model_validate({"name": "t", "match": {"models": ["m"]}, **fields})

    assert lower_tiers_for(None) == {"l2", "shared"}
    assert lower_tiers_for(tenant()) == {"l2", "shared"}
    assert lower_tiers_for(tenant(memory_only=True)) == frozenset()
    assert lower_tiers_for(tenant(budgets={"l2_bytes": 0})) == {"shared"}
    assert lower_tiers_for(tenant(budgets={"shared_bytes": "0"})) == {"l2"}


@pytest.mark.parametrize(
    ("tenants", "named"),
    [
        ([{"name": "a", "pinned": True, "match": {"models": ["m"]}}], "needs budgets.l1_bytes"),
        ([{"name": "a"}], "match needs cache_salts"),
        ([{"name": "Team A", "match": {"models": ["m"]}}], "tenants.0.name"),
        ([{"name": "default", "match": {"models": ["m"]}}], "tenants.0.name"),
        (
            [{"name": "a", "match": {"models": ["m"]}}, {"name": "a", "match": {"models": ["n"]}}],
            "tenant name 'a' is used twice",
        ),
        (
            [
                {
                    "name": "a",
                    "match": {"models": ["m"]},
                    "pinned": True,
                    "budgets": {"l1_bytes": "3Mi"},
                }
            ],
            "more than half of l1.size_bytes",
        ),
    ],
)
def test_a_tenant_the_sidecar_could_not_honour_is_refused_naming_it(
    tenants: list[dict[str, object]], named: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        config_from_dict({"l1": {"size_bytes": "4Mi"}, "tenants": tenants})
    assert named in str(refused.value)


SHARED_BUDGET = {"name": "a", "match": {"models": ["m"]}, "budgets": {"shared_bytes": "1Gi"}}


@pytest.mark.parametrize(
    ("shared", "tenant", "named"),
    [
        (
            {"backend": "s3"},
            SHARED_BUDGET,
            "tenants.0.budgets.shared_bytes ('a'): shared.backend s3 cannot enforce a byte budget",
        ),
        (
            {"backend": "valkey"},
            SHARED_BUDGET,
            "tenants.0.budgets.shared_bytes ('a'): a Valkey budget needs an expiry",
        ),
    ],
)
def test_a_shared_budget_the_backend_cannot_hold_is_refused_naming_the_backend(
    shared: dict[str, object], tenant: dict[str, object], named: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        config_from_dict({"shared": shared, "tenants": [tenant]})
    assert named in str(refused.value)
    if shared["backend"] == "s3":
        assert "shared.backend valkey, which enforces it" in str(refused.value)


@pytest.mark.parametrize(
    ("shared", "tenant", "kept"),
    [
        ({"backend": "valkey", "valkey": {"ttl_seconds": 3600}}, SHARED_BUDGET, 1 << 30),
        ({"backend": "valkey"}, {**SHARED_BUDGET, "ttl_seconds": 60}, 1 << 30),
        ({"backend": "s3"}, {**SHARED_BUDGET, "budgets": {"shared_bytes": 0}}, 0),
        ({"backend": "none"}, SHARED_BUDGET, 1 << 30),  # no tier: nothing to hold
    ],
)
def test_a_shared_budget_is_accepted_where_it_holds(
    shared: dict[str, object], tenant: dict[str, object], kept: int
) -> None:
    config = config_from_dict({"shared": shared, "tenants": [tenant]})
    assert config.tenants[0].budgets.shared_bytes == kept


def test_a_chunk_promoted_from_l2_stays_its_tenants_and_ages_from_its_first_store(
    tmp_path: Path,
) -> None:
    clock = Clock()
    daily = {
        "name": "daily",
        "match": {"cache_salts": ["d"]},
        "ttl_seconds": 60,
        "budgets": {"l1_bytes": "64Ki"},  # four chunks
    }
    with _engine(tmp_path, clock, daily) as engine:
        keys = [make_key(10 + i) for i in range(5)]
        for key in keys:  # each written to L2 before the next (a queued write pins it)
            assert engine.put(key, payload_for(key, CHUNK), _meta("daily"))
            assert engine.flush(timeout=30)
        assert engine.lookup(keys[:1]).tiers == ["l2"]  # its own budget evicted the first
        clock.now += 30.0
        assert engine.get(keys[0]) == payload_for(keys[0], CHUNK)  # promoted into L1
        assert engine.stats().tenants.l1_bytes == {"daily": 4 * CHUNK}
        clock.now += 30.0  # 60 s after the first store, 30 s after the promotion
        assert engine.lookup(keys[:1]).hit_chunks == 0
        for key in keys:
            engine.remove(key)
        # What the tenant was charged for its chunks is what their removal gave back.
        assert engine.stats().tenants.l1_bytes.get("daily", 0) == 0


def test_after_a_restart_a_sealed_l2_file_ages_by_its_tenants_ttl_from_when_it_was_written(
    tmp_path: Path,
) -> None:
    import os
    import time

    from kvstrata.sidecar.sealing import KeyRing
    from kvstrata.testing.keyfolder import MountedSecret, key_files

    MountedSecret(tmp_path / "keys").publish(key_files({"k1": os.urandom(32)}, writing="k1"))
    daily = {"name": "daily", "match": {"cache_salts": ["d"]}, "ttl_seconds": 60}
    config = _engine(tmp_path, Clock(), daily).config
    old, young, plain = make_key(31), make_key(32), make_key(33)
    with StorageManager(config, keys=KeyRing("on", str(tmp_path / "keys"))) as engine:
        for key, tenant in ((old, "daily"), (young, "daily"), (plain, "")):
            assert engine.put(key, payload_for(key, CHUNK), _meta(tenant))
        assert engine.flush(timeout=30)
        assert engine.l2 is not None
        old_file = engine.l2.path_of(old)
    hour_ago = time.time() - 3600
    os.utime(old_file, (hour_ago, hour_ago))  # written an hour before the restart

    clock = Clock()
    with StorageManager(config, clock=clock, keys=KeyRing("on", str(tmp_path / "keys"))) as engine:
        # The restarted sidecar knows the files' tenant from their sealed headers:
        # the hour-old one is past daily's TTL, the others are not.
        assert engine.lookup([young]).tiers == ["l2"]
        assert engine.lookup([old]).hit_chunks == 0
        assert engine.l2 is not None and not engine.l2.contains(old)
        assert engine.stats().tenants.expirations == {("daily", "l2"): 1}
        clock.now += 3600.0  # long after: the young one too; the default tenant has no TTL
        assert engine.lookup([young]).hit_chunks == 0
        assert engine.get(plain) == payload_for(plain, CHUNK)
