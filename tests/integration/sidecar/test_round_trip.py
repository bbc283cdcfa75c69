"""Round trips through SidecarClient against a real sidecar process."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

NBYTES = 4096


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory, kit: Any) -> Iterator[Any]:
    """One sidecar for the tests below that do not restart it (each uses its
    own keys and owners, and releases what it takes)."""
    sidecar = kit.Sidecar(tmp_path_factory.mktemp("round-trip") / "sc").start()
    try:
        yield sidecar
    finally:
        sidecar.stop()
        sidecar.cleanup()


def test_stored_chunks_are_found_by_lookup_and_retrieved_byte_for_byte(sidecar: Any, kit: Any):
    client = sidecar.client()
    keys = kit.make_keys(6, seed=1)
    assert kit.store(client, keys[:4], NBYTES, owner="req-a") == 4

    reply = client.lookup(keys, prefetch=False, owner="req-b")
    assert reply is not None
    assert reply.hit_chunks == 4
    assert reply.tiers == ["l1"] * 4

    chunks = kit.retrieve(client, keys[:4], owner="req-b")
    assert chunks == [kit.payload(k, NBYTES) for k in keys[:4]]
    assert client.errors == {}
    client.close()


def test_retrieve_stops_at_the_first_missing_chunk(sidecar: Any, kit: Any):
    client = sidecar.client()
    keys = kit.make_keys(4, seed=2)
    kit.store(client, [keys[0], keys[2]], NBYTES, owner="req")
    chunks = kit.retrieve(client, keys, owner="req")
    assert chunks == [kit.payload(keys[0], NBYTES), None, None, None]
    client.close()


def test_storing_a_chunk_twice_hands_out_no_second_slot(sidecar: Any, kit: Any):
    client = sidecar.client()
    keys = kit.make_keys(2, seed=3)
    kit.store(client, keys[:1], NBYTES, owner="req")
    slots = client.prepare_store(keys, NBYTES, "uint8", (NBYTES,), "req")
    assert slots is not None
    assert slots[0] is None and slots[1] is not None
    assert client.commit_store([slots[1].lease_id], [False])  # abandoned: not an error
    assert client.lookup(keys, prefetch=False, owner="req").hit_chunks == 1
    client.close()


def test_prefetched_chunks_are_leased_until_end_request(sidecar: Any, kit: Any):
    client = sidecar.client()
    keys = kit.make_keys(3, seed=4)
    kit.store(client, keys, NBYTES, owner="writer")
    kit.wait_until(lambda: sidecar.status()["leases_active"] == 0, 5, "stores settled")

    reply = client.lookup(keys, prefetch=True, owner="req-p")
    assert reply is not None and reply.hit_chunks == 3
    kit.wait_until(lambda: sidecar.status()["leases_active"] >= 1, 5, "prefetch leases")
    assert kit.retrieve(client, keys, owner="req-p") == [kit.payload(k, NBYTES) for k in keys]

    assert client.end_request("req-p")
    kit.wait_until(lambda: sidecar.status()["leases_active"] == 0, 5, "prefetch leases released")
    client.close()


def test_end_request_releases_unreleased_read_and_write_leases(sidecar: Any, kit: Any):
    client = sidecar.client()
    keys = kit.make_keys(4, seed=5)
    kit.store(client, keys[:2], NBYTES, owner="writer")
    assert client.prepare_retrieve(keys[:2], "req-x") is not None
    assert client.prepare_store(keys[2:], NBYTES, "uint8", (NBYTES,), "req-x") is not None
    assert kit.client_leases(sidecar, client) == 4

    assert client.end_request("req-x")
    assert kit.client_leases(sidecar, client) == 0
    kit.wait_until(lambda: sidecar.status()["leases_active"] == 0, 5, "engine leases released")
    # The abandoned write reservations were not published.
    assert client.lookup(keys, prefetch=False, owner="req-y").hit_chunks == 2
    client.close()


def test_one_client_cannot_release_or_commit_another_clients_leases(sidecar: Any, kit: Any):
    a, b = sidecar.client(), sidecar.client()
    keys = kit.make_keys(2, seed=6)
    kit.store(a, keys[:1], NBYTES, owner="w")
    read = a.prepare_retrieve(keys[:1], "req")
    write = a.prepare_store(keys[1:], NBYTES, "uint8", (NBYTES,), "req")
    assert read and read[0] and write and write[0]

    assert b.commit_store([write[0].lease_id], [True]) is False
    assert b.errors.get("commit_refused") == 1
    assert b.release([read[0].lease_id])  # answered, but nothing of a's is released
    assert kit.client_leases(sidecar, a) == 2
    assert a.end_request("req")
    assert kit.client_leases(sidecar, a) == 0
    a.close()
    b.close()


def test_restarted_sidecar_serves_hits_from_disk_and_clients_reconnect(
    sidecar_factory: Any, kit: Any
):
    sidecar = sidecar_factory().start()
    client = sidecar.client()
    keys = kit.make_keys(5, seed=7)
    assert kit.store(client, keys, NBYTES, owner="w") == 5
    kit.wait_until(
        lambda: sidecar.status()["tiers"]["l2"]["objects"] >= 5, 10, "write-behind into L2"
    )
    epoch = client.epoch
    assert sidecar.stop() == 0

    sidecar.start()
    reply = kit.wait_until(
        lambda: client.lookup(keys, prefetch=False, owner="r"), 10, "client reconnects"
    )
    assert client.epoch > epoch
    assert reply.hit_chunks == 5
    assert reply.tiers == ["l2"] * 5
    assert kit.retrieve(client, keys, owner="r") == [kit.payload(k, NBYTES) for k in keys]
    client.close()


def test_one_client_shared_by_threads_keeps_every_reply_with_its_caller(sidecar: Any, kit: Any):
    import threading

    client = sidecar.client()
    failures: list[str] = []

    def worker(n: int) -> None:
        for i in range(15):
            keys = kit.make_keys(2, seed=10_000 * (n + 1) + i)
            try:
                assert kit.store(client, keys, NBYTES, owner=f"t{n}") == 2
                reply = client.lookup(keys, prefetch=False, owner=f"t{n}")
                assert reply is not None and reply.hit_chunks == 2
                assert kit.retrieve(client, keys, owner=f"t{n}") == [
                    kit.payload(k, NBYTES) for k in keys
                ]
            except AssertionError as exc:
                failures.append(f"thread {n} round {i}: {exc}")
                return

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert failures == []
    assert client.errors == {}
    client.close()


def test_a_ping_after_an_unnoticed_restart_reconnects_to_the_new_arena(
    sidecar_factory: Any, kit: Any
):
    sidecar = sidecar_factory().start()
    client = sidecar.client()
    assert client.ping()
    old_arena, epoch = sidecar.status()["arena"]["name"], client.epoch
    assert sidecar.stop() == 0
    sidecar.start()  # no call in between: the client has not noticed

    assert kit.wait_until(client.ping, 10, "ping answered by the new sidecar")
    assert client.epoch == epoch + 1
    new_arena = sidecar.status()["arena"]["name"]
    assert new_arena != old_arena
    keys = kit.make_keys(1, seed=40)
    assert kit.store(client, keys, NBYTES, owner="w") == 1  # written into the new segment
    assert kit.retrieve(client, keys, owner="r") == [kit.payload(keys[0], NBYTES)]
    client.close()
