"""The Valkey tier under real faults: a killed server, bad AUTH, a dead seed.

Every fault is real: the server process is SIGKILLed and started again on
the same port, or started with ``requirepass``.
"""

from __future__ import annotations

import os
import signal
import threading

import pytest

from kvstrata.sidecar.keys import Namespace, make_key
from kvstrata.sidecar.objformat import ChunkMeta
from kvstrata.sidecar.tiers.factory import build_shared_tier
from kvstrata.sidecar.tiers.valkey import ValkeyTier
from kvstrata.testing.servers import RedisClusterServers, RedisServer, free_port, wait_for

NS = Namespace(model="valkey-faults").fingerprint()
META = ChunkMeta(dtype="uint8", shape=(4096,))


def key(i: int):
    return make_key(NS, i.to_bytes(32, "big"))


@pytest.fixture
def fast_failing(valkey_config):
    """A tier factory with short deadlines and a quick breaker."""
    return lambda url, **overrides: _fast_failing(valkey_config, url, **overrides)


def _fast_failing(valkey_config, url: str, **overrides) -> ValkeyTier:
    config = valkey_config(
        url,
        breaker_failures=3,
        breaker_reset_seconds=0.2,
        valkey={"timeout_seconds": 0.2, **overrides.pop("valkey", {})},
        **overrides,
    )
    tier = build_shared_tier(config)
    assert isinstance(tier, ValkeyTier)
    return tier


def test_killed_server_costs_misses_opens_the_breaker_and_recovers(
    own_valkey_server: RedisServer, fast_failing
) -> None:
    tier = fast_failing(own_valkey_server.url)
    data = os.urandom(4096)
    assert tier.put(key(0), data, META)
    errors: list[BaseException] = []
    stop = threading.Event()

    def traffic() -> None:  # a writer and reader that keeps going through the fault
        i = 1
        while not stop.is_set():
            try:
                tier.put(key(i), data, META)
                tier.get(key(i - 1))
                tier.contains_many([key(i), key(i + 1)])
            except BaseException as exc:  # the contract: nothing may escape
                errors.append(exc)
            i += 1

    worker = threading.Thread(target=traffic)
    worker.start()
    try:
        own_valkey_server.stop()
        wait_for(lambda: tier.stats().degraded, 5, "the breaker to open")
        stats = tier.stats()
        assert stats.errors_total.get("connection", 0) >= 3
        assert tier.get(key(0)) is None

        skipped_before = tier.stats().errors_total.get("breaker_open", 0)
        for i in range(50):
            assert tier.get(key(i)) is None
        # While open, calls are answered without touching the network.
        assert tier.stats().errors_total.get("breaker_open", 0) > skipped_before

        own_valkey_server.start()  # same port, empty: it was killed without saving
        wait_for(
            lambda: tier.put(key(0), data, META) and tier.get(key(0)) is not None,
            10,
            "hits after the restart",
        )
        wait_for(lambda: not tier.stats().degraded, 5, "the breaker to close")
    finally:
        stop.set()
        worker.join(timeout=10)
        tier.close()
    assert errors == []
    assert tier.stats().hits_total >= 1


def test_unreachable_server_at_start_is_degraded_not_an_error(fast_failing) -> None:
    tier = fast_failing(f"redis://127.0.0.1:{free_port()}/0")
    for i in range(5):
        assert tier.put(key(i), b"x" * 10, META) is False
        assert tier.get(key(i)) is None
        assert tier.contains_many([key(i)]) == [False]
    assert tier.stats().degraded
    assert tier.stats().errors_total["connection"] >= 3
    tier.close()


def test_unreachable_cluster_seed_is_degraded_not_an_error(fast_failing) -> None:
    tier = fast_failing(f"redis://127.0.0.1:{free_port()}/0", valkey={"cluster": True})
    assert tier.get(key(1)) is None
    assert tier.contains_many([key(1), key(2)]) == [False, False]
    assert sum(tier.stats().errors_total.values()) >= 2
    tier.close()


def test_auth_from_password_file_and_wrong_password_counts_auth_errors(
    tmp_path, fast_failing
) -> None:
    with RedisServer(tmp_path / "auth", password="s3cret-pw") as server:
        good = tmp_path / "good"
        good.write_text("s3cret-pw\n")
        bad = tmp_path / "bad"
        bad.write_text("not-it\n")
        tier = fast_failing(server.url, valkey={"password_file": str(good)})
        assert tier.put(key(1), b"y" * 10, META)
        assert tier.get(key(1)) is not None
        intruder = fast_failing(server.url, valkey={"password_file": str(bad), "key_prefix": "x:"})
        assert intruder.get(key(1)) is None
        assert intruder.stats().errors_total.get("auth", 0) >= 1
        tier.close()
        intruder.close()


def test_unreadable_password_file_is_refused_naming_the_field(tmp_path, valkey_config) -> None:
    config = valkey_config(
        "redis://127.0.0.1:1/0", valkey={"password_file": str(tmp_path / "missing")}
    )
    try:
        build_shared_tier(config)
    except ValueError as exc:
        assert "shared.valkey.password_file" in str(exc)
    else:
        raise AssertionError("a missing password file must be refused")


def test_ttl_is_set_on_stored_objects(valkey_server: RedisServer, fast_failing) -> None:
    import redis

    tier = fast_failing(valkey_server.url, valkey={"ttl_seconds": 120})
    assert tier.put(key(9), b"z" * 10, META)
    raw = redis.Redis(port=valkey_server.port)
    ttl = raw.ttl(tier._name(key(9)))
    assert 0 < ttl <= 120
    tier.clear()
    tier.close()
    raw.close()


def test_cluster_url_naming_a_database_is_refused_naming_the_field(valkey_config) -> None:
    config = valkey_config("redis://127.0.0.1:7000/3", cluster=True)
    with pytest.raises(ValueError, match=r"shared\.valkey\.url"):
        build_shared_tier(config)


def test_cluster_node_killed_and_restarted_costs_misses_then_hits_again(
    tmp_path, fast_failing
) -> None:
    with RedisClusterServers(tmp_path / "cluster") as cluster:
        tier = fast_failing(cluster.url, valkey={"cluster": True})
        keys = [key(i) for i in range(100, 130)]  # spread over all three nodes' slots
        assert tier.put_many([(k, b"v" * 64, META) for k in keys]) == [True] * len(keys)
        victim = cluster.servers[1]
        victim.stop()
        for k in keys:  # some keys live on the dead node: misses, never exceptions
            tier.get(k)
        assert sum(tier.stats().errors_total.values()) >= 1
        victim.start()  # same port and data dir: it rejoins with its nodes.conf
        wait_for(cluster.is_ok, 15, "the cluster to be whole again")
        wait_for(
            lambda: (
                all(tier.put_many([(k, b"v" * 64, META) for k in keys]))
                and all(g is not None for g in tier.get_many(keys))
            ),
            15,
            "hits on every node after the restart",
        )
        tier.close()


@pytest.mark.timeout(60)
def test_hung_server_answers_within_the_deadlines_and_recovers(
    own_valkey_server: RedisServer, fast_failing
) -> None:
    tier = fast_failing(own_valkey_server.url, lookup_timeout_seconds=0.05)
    assert tier.put(key(1), b"w" * 64, META)
    assert tier.contains_many([key(1)]) == [True]
    own_valkey_server.process.send_signal(signal.SIGSTOP)  # a hung server: no replies
    try:
        # Each call ends by its deadline (a timeout counted, or the breaker
        # those timeouts opened), never by waiting for the server:
        # pytest-timeout ends the test if one hangs.
        before = tier.stats().errors_total.get("timeout", 0)
        assert tier.contains_many([key(1), key(2)]) == [False, False]
        assert tier.stats().errors_total.get("timeout", 0) == before + 1
        assert tier.get(key(1)) is None
        errors = tier.stats().errors_total
        assert errors.get("timeout", 0) + errors.get("breaker_open", 0) == before + 2, errors
    finally:
        own_valkey_server.process.send_signal(signal.SIGCONT)
    wait_for(lambda: tier.get(key(1)) is not None, 10, "hits once the server answers again")
    tier.close()


def test_full_server_refuses_writes_but_keeps_serving_reads(tmp_path, fast_failing) -> None:
    with RedisServer(tmp_path / "full", extra_args=("--maxmemory", "2mb")) as server:
        tier = fast_failing(server.url)
        first = key(500)
        assert tier.put(first, b"k" * 1024, META)
        refused = [tier.put(key(600 + i), os.urandom(256 << 10), META) for i in range(24)]
        assert not all(refused)  # maxmemory reached, noeviction: writes refused
        stats = tier.stats()
        assert stats.errors_total.get("full", 0) >= 1
        assert not stats.degraded  # the server answers: no reason to cut off reads
        got = tier.get(first)
        assert got is not None and bytes(got.payload) == b"k" * 1024
        tier.close()
