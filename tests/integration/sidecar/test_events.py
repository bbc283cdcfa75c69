"""EVENTS: a real sidecar's journal of what arrived in and left each tier,
read through the real client (the feed behind the connector's KV events)."""

from __future__ import annotations

from typing import Any

from kvstrata.connector.client import SidecarClient
from kvstrata.sidecar import protocol as p
from kvstrata.sidecar.journal import EventJournal
from kvstrata.sidecar.keys import Namespace

NBYTES = 64 * 1024
OTHER_TENANT = Namespace(model="another-tenant", block_size=16, chunk_size=16)


def _read_all(client: SidecarClient, after: int = 0) -> tuple[list[p.TierEvent], int]:
    events: list[p.TierEvent] = []
    while True:
        reply = client.events(after, limit=64)
        assert reply is not None, client.errors
        events += reply.events
        if reply.next_seq == after:
            return events, after
        after = reply.next_seq


def test_stores_reach_the_journal_per_tier_in_order(sidecar: Any, kit: Any):
    client = sidecar.client()
    keys = kit.make_keys(3, seed=700)
    assert kit.store(client, keys, NBYTES, owner="w") == 3

    def l2_has_all() -> bool:
        events, _ = _read_all(client)
        return {bytes(e.key) for e in events if e.tier == "l2"} == set(map(bytes, keys))

    kit.wait_until(l2_has_all, timeout=10, what="the L2 write-behind of three chunks")
    events, last = _read_all(client)
    assert [(e.kind, bytes(e.key)) for e in events if e.tier == "l1"] == [
        ("stored", bytes(k)) for k in keys
    ]
    assert all(e.kind == "stored" for e in events)
    assert [e.seq for e in events] == sorted({e.seq for e in events})  # strictly increasing
    # A caught-up reader gets nothing and keeps its place.
    reply = client.events(last)
    assert reply is not None and reply.events == [] and reply.next_seq == last
    client.close()


def test_an_l1_eviction_is_a_removed_record(sidecar: Any, kit: Any):
    client = sidecar.client()
    # The test sidecar's L1 is 16 MiB: 40 chunks of 1 MiB evict the oldest.
    keys = kit.make_keys(40, seed=710)
    for i in range(0, 40, 4):
        kit.store(client, keys[i : i + 4], 1 << 20, owner=f"w{i}")
    events, _ = _read_all(client)
    removed = [bytes(e.key) for e in events if e.tier == "l1" and e.kind == "removed"]
    assert removed, "no L1 eviction was recorded"
    assert removed[0] == bytes(keys[0])  # LRU: the first stored leaves first
    stored_at = {bytes(e.key): e.seq for e in events if e.tier == "l1" and e.kind == "stored"}
    for e in events:
        if e.tier == "l1" and e.kind == "removed":
            assert stored_at[bytes(e.key)] < e.seq
    client.close()


def test_a_session_sees_only_its_own_namespaces_records(sidecar: Any, kit: Any):
    tenant = sidecar.client()
    kit.store(tenant, kit.make_keys(2, seed=720), NBYTES, owner="w")
    other = SidecarClient(sidecar.endpoint, OTHER_TENANT, role="scheduler", call_timeout_s=2)
    events, _ = _read_all(other)
    assert events == []
    mine, _ = _read_all(tenant)
    assert len([e for e in mine if e.tier == "l1"]) == 2
    tenant.close()
    other.close()


def test_a_bad_events_request_is_refused_naming_the_field(sidecar: Any):
    client = sidecar.client()
    assert client.events(0, limit=p.MAX_EVENTS + 1) is None
    assert client.errors.get(p.E_BAD_REQUEST) == 1
    assert client.events(0) is not None  # and the sidecar keeps serving
    client.close()


def test_a_reader_that_falls_behind_the_ring_is_told_how_much_it_lost():
    journal = EventJournal(capacity=4)
    for i in range(10):
        journal.record("stored", "l1", bytes([i]) * 48)
    read = journal.read(after=2, limit=100)
    assert [r[0] for r in read.records] == [7, 8, 9, 10]
    assert read.lost == 4  # records 3..6 fell out of the ring
    assert read.next_seq == 10
    # A reader numbered by a previous sidecar (after > last) starts over.
    assert [r[0] for r in journal.read(after=99, limit=100).records] == [7, 8, 9, 10]
