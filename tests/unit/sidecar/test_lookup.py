"""Per-tier lookup denominators: the chunks a lookup consulted each tier for.

A tier's hit rate is its hits over the chunks the prefix walk reached it with
(not found in a faster tier, before the first chunk no tier holds); these
tests place chunks in known tiers and count by hand.
"""

from __future__ import annotations

from kvstrata.sidecar.engine import StorageManager
from kvstrata.sidecar.objformat import ChunkMeta
from kvstrata.sidecar.tiers.disk import DiskTier

from ..conftest import engine_config, make_key, payload_for

META = ChunkMeta(dtype="uint8", shape=(4096,))
NBYTES = 4096


class SharedDirTier(DiskTier):
    """A real directory tier standing in as the shared tier."""

    name = "shared"


def test_local_walk_counts_l1_for_every_chunk_reached_and_l2_for_l1_misses(tmp_path):
    config = engine_config(tmp_path)
    with StorageManager(config) as engine:
        a, b, c, d = (make_key(i) for i in range(4))
        engine.put(a, payload_for(a, NBYTES), META)  # L1
        engine.l2.put(b, payload_for(b, NBYTES), META)  # L2 only
        result = engine.lookup([a, b, c, d])  # c: nowhere, so d is never reached
        assert result.tiers == ["l1", "l2"]
        assert result.asked == {"l1": 3, "l2": 2}


def test_the_shared_tier_is_counted_for_the_chunks_the_walk_reaches_it_with(tmp_path):
    shared = SharedDirTier(tmp_path / "shared", 1 << 22)
    a, b, c, d, e = (make_key(i) for i in range(5))
    for key in (b, c):
        shared.put(key, payload_for(key, NBYTES), META)
    with StorageManager(engine_config(tmp_path), shared_tier=shared) as engine:
        engine.put(a, payload_for(a, NBYTES), META)
        result = engine.lookup([a, b, c, d, e])
        assert result.tiers == ["l1", "shared", "shared"]
        # a, b, c, d reach L1; b, c, d miss it and reach L2 then the shared tier.
        assert result.asked == {"l1": 4, "l2": 3, "shared": 3}


def test_a_full_l1_hit_never_consults_the_tiers_below(tmp_path):
    shared = SharedDirTier(tmp_path / "shared", 1 << 22)
    keys = [make_key(i) for i in range(3)]
    with StorageManager(engine_config(tmp_path), shared_tier=shared) as engine:
        for key in keys:
            engine.put(key, payload_for(key, NBYTES), META)
        result = engine.lookup(keys)
        assert result.tiers == ["l1"] * 3
        assert result.asked == {"l1": 3, "l2": 0}
