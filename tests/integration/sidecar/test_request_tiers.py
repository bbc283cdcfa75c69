"""Per-request tier choice, against a real sidecar over its real ZeroMQ socket,
with L2 on disk and a real redis-server as the shared tier: a store keeps its
chunks out of the tiers it leaves out of ``store_tiers`` (no L2 file, no
Valkey key), a lookup finds only what its ``load_tiers`` hold, and an unknown
tier is refused naming the field and the tier, counted, while the sidecar
keeps serving."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import redis

from kvstrata.sidecar import protocol as p
from kvstrata.sidecar.keys import key_hex
from kvstrata.sidecar.tiers.disk import SUFFIX
from kvstrata.testing.rawpeer import RawPeer

from .conftest import shared_valkey

CHUNK = 64 << 10


def _written_behind(sidecar: Any) -> bool:
    s = sidecar.samples()
    queued = s['kvstrata_write_queue_depth{tier="l2"}'] + s.get(
        'kvstrata_write_queue_depth{tier="valkey"}', 0
    )
    return queued == 0 == s["kvstrata_writeback_pinned_bytes"]


def _l2_file(sidecar: Any, key: bytes) -> Path:
    hexkey = key_hex(key)
    return Path(sidecar.root) / "l2" / hexkey[-2:] / f"{hexkey}{SUFFIX}"


def _store(kit: Any, client: Any, keys: list[Any], tiers: frozenset[str] | None) -> None:
    slots = client.prepare_store(keys, CHUNK, "uint8", (CHUNK,), "req", store_tiers=tiers)
    assert slots is not None and all(slots), client.errors
    arena = client.arena
    for key, slot in zip(keys, slots, strict=True):
        arena[slot.offset : slot.offset + slot.length] = kit.payload(key, CHUNK)
    assert client.commit_store([s.lease_id for s in slots], [True] * len(slots))


def test_store_tiers_keep_chunks_out_of_the_tiers_left_out_and_load_tiers_limit_hits(
    sidecar_factory: Any, kit: Any, valkey: Any
):
    shared = shared_valkey(valkey.url)
    sidecar = sidecar_factory("tiers", {"shared": shared, "l1": {"size_bytes": "8Mi"}}).start()
    client = sidecar.client(call_timeout_s=5.0)
    memory_only, local_only, everywhere = (kit.make_keys(3, seed=s) for s in (41, 42, 43))
    _store(kit, client, memory_only, frozenset({"l1"}))
    _store(kit, client, local_only, frozenset({"l1", "l2"}))
    _store(kit, client, everywhere, None)
    kit.wait_until(lambda: _written_behind(sidecar), 20, "write-behind to drain")

    # What reached each tier, read from the tiers themselves.
    assert not any(_l2_file(sidecar, k).exists() for k in memory_only)
    assert all(_l2_file(sidecar, k).exists() for k in local_only + everywhere)
    prefix = shared["valkey"]["key_prefix"]
    stored = set(redis.Redis.from_url(valkey.url).scan_iter(match=f"{prefix}*"))
    in_valkey = {k for k in memory_only + local_only + everywhere
                 if f"{prefix}{key_hex(k)}".encode() in stored}  # fmt: skip
    assert in_valkey == set(everywhere)

    # A lookup sees only the tiers it names; a chunk only elsewhere is a miss.
    def hits(keys: list[Any], load: frozenset[str] | None) -> list[str]:
        reply = client.lookup(keys, prefetch=False, owner="look", load_tiers=load)
        assert reply is not None, client.errors
        return reply.tiers

    assert hits(memory_only, None) == ["l1"] * 3
    assert hits(memory_only, frozenset({"l2", "shared"})) == []
    assert hits(local_only, frozenset({"l2"})) == ["l2"] * 3
    assert hits(local_only, frozenset({"shared"})) == []
    assert hits(everywhere, frozenset({"shared"})) == ["valkey"] * 3
    client.close()


def test_an_unknown_tier_is_refused_naming_it_and_counted_and_the_sidecar_keeps_serving(
    sidecar: Any, kit: Any
):
    peer = RawPeer(sidecar.endpoint)
    peer.hello(kit.NAMESPACE.fingerprint())
    keys = [bytes(k) for k in kit.make_keys(2, seed=44)]
    before = sidecar.samples()['kvstrata_errors_total{kind="bad_request"}']
    lookup = {"keys": keys, "prefetch": False, "owner": "r", "load_tiers": ["l1", "l3"]}
    _, _, ok, body = peer.call(p.LOOKUP, lookup, request_id=7)
    assert (ok, body["code"]) == (False, p.E_BAD_REQUEST)
    assert "'load_tiers'" in body["message"] and "'l3'" in body["message"]
    store = {"keys": keys, "nbytes": CHUNK, "dtype": "uint8", "shape": [CHUNK], "owner": "r",
             "store_tiers": ["l2"]}  # fmt: skip
    _, _, ok, body = peer.call(p.PREPARE_STORE, store, request_id=8)
    assert (ok, body["code"]) == (False, p.E_BAD_REQUEST)
    assert "'store_tiers'" in body["message"] and "'l1'" in body["message"]
    assert sidecar.samples()['kvstrata_errors_total{kind="bad_request"}'] == before + 2
    # Still serving, this peer included.
    lookup["load_tiers"] = ["l1"]
    assert peer.call(p.LOOKUP, lookup, request_id=9)[2] is True
    peer.close()


def test_the_scheduler_looks_up_only_the_tiers_a_request_names_and_nothing_on_unreadable_params(
    sidecar: Any, kit: Any
):
    from types import SimpleNamespace

    from kvstrata.connector.metadata import KVStrataMetadata
    from kvstrata.connector.scheduler import KVStrataScheduler

    settings = kit.worker_settings(sidecar, model="tiers-sched")
    worker = kit.host_worker(sidecar, model="tiers-sched")
    saves = kit.chunk_requests("tiers-sched", 1, 2)
    worker.save(KVStrataMetadata(saves=saves))
    assert worker.counters.saved_chunks == 2, worker.client.errors
    worker.close()
    hashes = [c.chunk_hash for c in saves[0].chunks]
    blocks = [b for h in hashes for b in (b"\1" * 32, h)]  # chunk i keyed by its last block
    scheduler = KVStrataScheduler(settings)

    def matched(req_id: str, params: dict[str, Any]) -> int:
        req = SimpleNamespace(request_id=req_id, num_prompt_tokens=2 * kit.WORKER_CHUNK + 1,
                              block_hashes=blocks, kv_transfer_params=params)  # fmt: skip

        def answer() -> tuple[int] | None:
            n = scheduler.get_num_new_matched_tokens(req, 0)
            return None if n is None else (n,)

        found = kit.wait_until(answer, 10, "the lookup's answer", step=0.005)[0]
        scheduler.request_finished(req_id)
        return int(found)

    try:
        assert matched("in-l1", {"kvstrata": {"load_tiers": ["l1"]}}) == 2 * kit.WORKER_CHUNK
        assert matched("shared-only", {"kv_load_tiers": [{"locality": "remote"}]}) == 0
        assert matched("none", {"kv_load_tiers": []}) == 0
        assert scheduler.counters.bad_params == 0
        assert matched("unreadable", {"kvstrata": {"load_tiers": ["l9"]}}) == 0
        assert scheduler.counters.bad_params == 1
    finally:
        scheduler.close()


def _push_out_of_l1(kit: Any, client: Any, seed: int) -> None:
    """Chunks kept in L1 only, enough to push every earlier chunk out of the
    tests' 8 MiB arena."""
    flood = kit.make_keys(160, seed=seed)
    for i in range(0, len(flood), 16):
        _store(kit, client, flood[i : i + 16], frozenset({"l1"}))


def _read_back_promoted(kit: Any, client: Any, sidecar: Any, keys: list, tier: str) -> None:
    """``keys`` read back whole, each promoted into L1 from ``tier``."""
    assert kit.retrieve(client, keys, owner="read") == [kit.payload(k, CHUNK) for k in keys]
    assert sidecar.samples()[f'kvstrata_promotions_total{{tier="{tier}"}}'] >= len(keys)


def test_a_chunk_promoted_from_l2_keeps_its_store_choice_and_stays_out_of_the_shared_tier(
    sidecar_factory: Any, kit: Any, valkey: Any
):
    # Admission "reused": a chunk promoted from L2 is a hit, which uploads it.
    shared = shared_valkey(valkey.url, admission="reused")
    sidecar = sidecar_factory("promoted", {"shared": shared, "l1": {"size_bytes": "8Mi"}}).start()
    client = sidecar.client(call_timeout_s=5.0)
    local_only = kit.make_keys(3, seed=45)
    _store(kit, client, local_only, frozenset({"l1", "l2"}))
    kit.wait_until(lambda: _written_behind(sidecar), 20, "write-behind to drain")
    assert all(_l2_file(sidecar, k).exists() for k in local_only)

    _push_out_of_l1(kit, client, seed=46)
    reply = client.lookup(local_only, prefetch=False, owner="look")
    assert reply is not None and reply.tiers == ["l2"] * 3, client.errors

    # Read back: promoted from L2 into L1, and not uploaded for being a hit.
    _read_back_promoted(kit, client, sidecar, local_only, "l2")
    kit.wait_until(lambda: _written_behind(sidecar), 20, "write-behind to drain")
    prefix = shared["valkey"]["key_prefix"]
    server = redis.Redis.from_url(valkey.url)
    assert not any(server.exists(f"{prefix}{key_hex(k)}") for k in local_only)
    server.close()
    client.close()


def test_a_local_only_chunk_stays_out_of_the_shared_tier_after_a_sidecar_restart(
    sidecar_factory: Any, kit: Any, valkey: Any
):
    # The restarted sidecar re-indexes L2 from its files: the choice must come
    # back with them, or the first reuse (admission "reused") uploads the chunk.
    shared = shared_valkey(valkey.url, admission="reused")
    sidecar = sidecar_factory("restart", {"shared": shared, "l1": {"size_bytes": "8Mi"}}).start()
    client = sidecar.client(call_timeout_s=5.0)
    local_only, everywhere = kit.make_keys(3, seed=51), kit.make_keys(2, seed=52)
    _store(kit, client, local_only, frozenset({"l1", "l2"}))
    _store(kit, client, everywhere, None)
    kit.wait_until(lambda: _written_behind(sidecar), 20, "write-behind to drain")
    assert all(_l2_file(sidecar, k).exists() for k in local_only + everywhere)
    client.close()

    sidecar.restart()  # an empty L1; L2 re-indexed from the files
    client = sidecar.client(call_timeout_s=5.0)
    _read_back_promoted(kit, client, sidecar, local_only + everywhere, "l2")
    kit.wait_until(lambda: _written_behind(sidecar), 20, "write-behind to drain")
    prefix = shared["valkey"]["key_prefix"]
    server = redis.Redis.from_url(valkey.url)
    assert not any(server.exists(f"{prefix}{key_hex(k)}") for k in local_only)
    assert all(server.exists(f"{prefix}{key_hex(k)}") for k in everywhere)  # reused: uploaded
    server.close()
    client.close()


def test_a_chunk_promoted_from_the_shared_tier_keeps_its_store_choice_and_stays_off_the_disk(
    sidecar_factory: Any, kit: Any, valkey: Any
):
    shared = shared_valkey(valkey.url)
    sidecar = sidecar_factory("upward", {"shared": shared, "l1": {"size_bytes": "8Mi"}}).start()
    client = sidecar.client(call_timeout_s=5.0)
    shared_only = kit.make_keys(3, seed=47)
    _store(kit, client, shared_only, frozenset({"l1", "shared"}))
    kit.wait_until(lambda: _written_behind(sidecar), 20, "write-behind to drain")
    _push_out_of_l1(kit, client, seed=48)
    reply = client.lookup(shared_only, prefetch=False, owner="look")
    assert reply is not None and reply.tiers == ["valkey"] * 3, client.errors

    # Promoted from Valkey into L1, and not written to L2 on its way up.
    _read_back_promoted(kit, client, sidecar, shared_only, "valkey")
    kit.wait_until(lambda: _written_behind(sidecar), 20, "write-behind to drain")
    assert not any(_l2_file(sidecar, k).exists() for k in shared_only)
    client.close()


def test_a_read_promotes_only_from_the_tiers_its_request_may_load_from(
    sidecar_factory: Any, kit: Any
):
    sidecar = sidecar_factory("reads", {"l1": {"size_bytes": "8Mi"}}).start()
    client = sidecar.client(call_timeout_s=5.0)
    on_disk = kit.make_keys(3, seed=49)
    _store(kit, client, on_disk, None)
    kit.wait_until(lambda: _written_behind(sidecar), 20, "write-behind to drain")
    flood = kit.make_keys(160, seed=50)
    for i in range(0, len(flood), 16):
        _store(kit, client, flood[i : i + 16], frozenset({"l1"}))
    reply = client.lookup(on_disk, prefetch=False, owner="look")
    assert reply is not None and reply.tiers == ["l2"] * 3, client.errors
    promoted = sidecar.samples().get('kvstrata_promotions_total{tier="l2"}', 0)

    # Evicted from L1 since: a read that may load from L1 only is a miss,
    # and nothing is promoted for it.
    slots = client.prepare_retrieve(on_disk, owner="l1-only", load_tiers=frozenset({"l1"}))
    assert slots == [None] * 3, client.errors
    assert sidecar.samples().get('kvstrata_promotions_total{tier="l2"}', 0) == promoted

    # A read that may load from L2 promotes them.
    slots = client.prepare_retrieve(on_disk, owner="any", load_tiers=frozenset({"l1", "l2"}))
    assert slots is not None and all(slots), client.errors
    arena = client.arena
    assert [bytes(arena[s.offset : s.offset + s.length]) for s in slots] == [
        kit.payload(k, CHUNK) for k in on_disk
    ]
    assert sidecar.samples().get('kvstrata_promotions_total{tier="l2"}', 0) == promoted + 3
    assert client.release([s.lease_id for s in slots])
    client.close()
