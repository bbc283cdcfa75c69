"""Leases are fair: one client's uncommitted writes hold only its share of L1,
and a request's end releases everything pinned for it, prefetches included."""

from __future__ import annotations

from typing import Any

from kvstrata.sidecar.config import SidecarConfig

CHUNK = 256 << 10  # 64 of them fill the test sidecar's 16 MiB arena


def test_a_client_that_never_commits_cannot_starve_the_stores_of_another(sidecar: Any, kit: Any):
    greedy, other = sidecar.client(client_id="greedy"), sidecar.client(client_id="other")
    held = greedy.prepare_store(kit.make_keys(64, seed=300), CHUNK, "uint8", (CHUNK,), "g")
    assert held is not None
    # The default share is a quarter of L1: 16 of the 64 chunks asked for.
    assert sum(s is not None for s in held) == 16
    keys = kit.make_keys(32, seed=301)
    assert (
        kit.store(other, keys[:16], CHUNK, owner="o1")
        + kit.store(other, keys[16:], CHUNK, owner="o2")
        == 32
    )
    greedy.close()
    other.close()


def test_one_prepare_store_the_size_of_the_arena_evicts_nobody_elses_chunks(sidecar: Any, kit: Any):
    owner, greedy = sidecar.client(client_id="owner"), sidecar.client(client_id="greedy")
    keys = kit.make_keys(32, seed=310)
    for part in (keys[:16], keys[16:]):  # one request holds at most a quarter of L1
        assert kit.store(owner, part, CHUNK, owner="o") == 16
    assert greedy.prepare_store(kit.make_keys(64, seed=311), CHUNK, "uint8", (CHUNK,), "g")
    found = owner.lookup(keys, prefetch=False, owner="o")
    assert found is not None and found.hit_chunks == 32
    assert found.tiers == ["l1"] * 32
    owner.close()
    greedy.close()


def test_end_request_right_after_a_prefetching_lookup_leaves_no_lease_behind(
    sidecar: Any, kit: Any
):
    keys = kit.make_keys(24, seed=320)
    writer = sidecar.client()
    assert kit.store(writer, keys[:12], CHUNK, owner="w") == 12
    assert kit.store(writer, keys[12:], CHUNK, owner="w") == 12
    writer.close()
    sidecar.restart()  # L1 is empty: the prefetch reads L2 on background threads
    client = sidecar.client()
    found = client.lookup(keys, prefetch=True, owner="req-1")
    assert found is not None and found.hit_chunks == 24
    assert client.end_request("req-1")

    def promoted() -> bool:
        return sidecar.status()["counters"].get("promotions_total_l2", 0) >= 24

    kit.wait_until(promoted, 10, "the prefetch finished")
    kit.wait_until(lambda: sidecar.status()["leases_active"] == 0, 3, "no lease left")
    client.close()


def test_a_lease_lasts_seconds_by_default():
    assert SidecarConfig().server.lease_seconds <= 10


def test_a_request_looked_up_again_and_again_holds_one_lease_per_chunk(sidecar: Any, kit: Any):
    """vLLM asks again every step for a waiting request: no lease pile-up."""
    keys = kit.make_keys(4, seed=330)
    writer = sidecar.client()
    assert kit.store(writer, keys, CHUNK, owner="w") == 4
    scheduler = sidecar.client(role="scheduler")
    for _ in range(5):
        found = scheduler.lookup(keys, prefetch=True, owner="req-1")
        assert found is not None and found.hit_chunks == 4
    assert sidecar.status()["leases_active"] == 4
    assert kit.client_leases(sidecar, writer) == 0
    assert scheduler.end_request("req-1")  # finished without ever loading
    assert sidecar.status()["leases_active"] == 0
    writer.close()
    scheduler.close()


def test_lookups_repeated_while_the_prefetch_runs_pin_each_chunk_once(sidecar: Any, kit: Any):
    keys = kit.make_keys(12, seed=340)
    writer = sidecar.client()
    assert kit.store(writer, keys, CHUNK, owner="w") == 12
    writer.close()
    sidecar.restart()  # L1 is empty: the prefetch reads L2 on background threads
    scheduler = sidecar.client(role="scheduler")
    for _ in range(5):
        found = scheduler.lookup(keys, prefetch=True, owner="req-2")
        assert found is not None and found.hit_chunks == 12

    def promoted() -> bool:
        return sidecar.status()["counters"].get("promotions_total_l2", 0) >= 12

    kit.wait_until(promoted, 10, "the prefetch finished")
    kit.wait_until(lambda: sidecar.status()["leases_active"] == 12, 3, "one lease per chunk")
    assert sidecar.status()["counters"]["prefetch_chunks_total"] == 12
    assert scheduler.end_request("req-2")
    assert sidecar.status()["leases_active"] == 0
    scheduler.close()
