"""The engine keeps serving from L1 while its shared tier is down.

A real Valkey server is SIGKILLed under a live :class:`StorageManager`: L1
hits, stores and lookups go on without an exception, the shared tier is
reported degraded with its errors counted, and after the server is back on
the same port chunks flow into it again.
"""

from __future__ import annotations

import os

import pytest

from kvstrata.sidecar.config import config_from_dict
from kvstrata.sidecar.engine import StorageManager
from kvstrata.sidecar.keys import Namespace, make_key
from kvstrata.sidecar.objformat import ChunkMeta
from kvstrata.sidecar.tiers.factory import build_shared_tier
from kvstrata.testing.servers import RedisServer, wait_for

NS = Namespace(model="engine-faults").fingerprint()
META = ChunkMeta(dtype="uint8", shape=(4096,))


@pytest.fixture
def engine(own_valkey_server: RedisServer, valkey_config):
    shared = valkey_config(
        own_valkey_server.url,
        breaker_failures=2,
        breaker_reset_seconds=0.2,
        valkey={"timeout_seconds": 0.2},
    )
    config = config_from_dict(
        {
            "chunk_size": 64,
            "l1": {"size_bytes": "16Mi", "pin_memory": False},
            "l2": {"enabled": False},
            "shared": shared.model_dump(mode="json"),
        }
    )
    manager = StorageManager(config, shared_tier=build_shared_tier(config.shared))
    yield manager
    manager.close()


def keys(n: int) -> list:
    return [make_key(NS, os.urandom(32)) for _ in range(n)]


def test_engine_serves_l1_while_the_shared_tier_is_down_and_refills_it_after(
    engine: StorageManager, own_valkey_server: RedisServer
) -> None:
    data = os.urandom(4096)
    before = keys(3)
    assert all(engine.put(k, data, META) for k in before)
    assert engine.flush(timeout=10)
    assert engine.shared.contains_many(before) == [True] * 3

    own_valkey_server.stop()
    during = keys(3)
    assert all(engine.put(k, data, META) for k in during)  # L1 takes them
    assert engine.flush(timeout=10)  # the write-behind gives up, it does not hang
    result = engine.lookup(before + during)
    assert result.hit_chunks == 6 and set(result.tiers) == {"l1"}
    assert engine.get(before[0]) == data
    assert engine.lookup(keys(2)).hit_chunks == 0
    shared = engine.stats().tiers[engine.shared.name]
    assert shared.degraded
    assert sum(v for k, v in shared.errors_total.items() if k != "breaker_open") >= 2

    own_valkey_server.start()  # empty: it was killed without saving
    after = keys(2)

    def refilled() -> bool:
        for k in after:
            engine.remove(k)
            engine.put(k, data, META)
        engine.flush(timeout=5)
        return all(engine.shared.contains_many(after))

    wait_for(refilled, 10, "writes to reach the restarted shared tier")
    assert not engine.stats().tiers[engine.shared.name].degraded
