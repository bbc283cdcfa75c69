"""The Valkey tier reports the evictions its server makes (INFO stats ``evicted_keys``).

The server evicts, not the tier: a real server with a small ``maxmemory`` and
``allkeys-lru`` is filled past it, and the tier's figure is compared with what
the server itself says through a plain client.
"""

from __future__ import annotations

import os

import redis

from kvstrata.sidecar.engine_metrics import _tier_metrics
from kvstrata.sidecar.keys import Namespace, make_key
from kvstrata.sidecar.objformat import ChunkMeta
from kvstrata.sidecar.tiers.factory import build_shared_tier
from kvstrata.sidecar.tiers.valkey import ValkeyTier
from kvstrata.testing.servers import RedisServer

NS = Namespace(model="valkey-evictions").fingerprint()
META = ChunkMeta(dtype="uint8", shape=(256 << 10,))


def key(i: int):
    return make_key(NS, i.to_bytes(32, "big"))


def test_the_servers_evicted_keys_are_the_tiers_figure(tmp_path, valkey_config) -> None:
    lru = ("--maxmemory", "2mb", "--maxmemory-policy", "allkeys-lru")
    with RedisServer(tmp_path / "lru", extra_args=lru) as server:
        tier = build_shared_tier(valkey_config(server.url))
        assert isinstance(tier, ValkeyTier)
        raw = redis.Redis.from_url(server.url)
        try:
            assert tier.stats().server_evicted_keys == 0
            for i in range(24):  # 6 MiB into 2 MiB: the server must evict
                assert tier.put(key(i), os.urandom(256 << 10), META)
            server_says = int(raw.info("stats")["evicted_keys"])
            assert server_says > 0
            assert tier.stats().server_evicted_keys == server_says
        finally:
            raw.close()
            tier.close()


def test_a_cluster_reports_the_sum_over_its_nodes(valkey_cluster, valkey_config) -> None:
    tier = build_shared_tier(valkey_config(valkey_cluster.url, cluster=True))
    assert isinstance(tier, ValkeyTier)
    try:
        assert tier.stats().server_evicted_keys == 0  # no maxmemory: nothing evicted
    finally:
        tier.close()


def test_an_unanswering_server_keeps_the_last_figure_and_the_scrape_works(
    tmp_path, valkey_config
) -> None:
    with RedisServer(tmp_path / "gone") as server:
        tier = build_shared_tier(valkey_config(server.url))
        assert isinstance(tier, ValkeyTier)
        assert tier.stats().server_evicted_keys == 0
    try:  # the server is stopped now
        stats = tier.stats()
        assert stats.server_evicted_keys == 0
        assert stats.errors_total == {}  # a scrape is not a tier failure
    finally:
        tier.close()


def test_tiers_without_a_server_figure_expose_no_series() -> None:
    from kvstrata.sidecar.engine import EngineStats
    from kvstrata.sidecar.tiers.stats import TierStats, ValkeyStats

    stats = EngineStats(
        tiers={
            "l1": TierStats(tier="l1"),
            "valkey": TierStats(tier="valkey", backend=ValkeyStats(server_evicted_keys=7)),
        },
    )
    family = next(f for f in _tier_metrics(stats) if f.name == "kvstrata_tier_server_evicted_keys")
    assert [(s.labels, s.value) for s in family.samples] == [({"tier": "valkey"}, 7.0)]
