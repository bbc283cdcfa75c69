"""EVENTS: a real sidecar's journal of what arrived in and left each tier,
read through the real client (the feed behind the connector's KV events)."""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import pytest

from kvstrata.connector.client import SidecarClient
from kvstrata.sidecar import protocol as p
from kvstrata.sidecar.journal import EventJournal
from kvstrata.sidecar.keys import ChunkKey, Namespace

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
    client = sidecar.client(kv_events=True)
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


def test_an_l1_eviction_is_a_removed_record(sidecar_factory: Any, kit: Any):
    # No L2: its write-behind pins a chunk while copying it out, and an
    # eviction that meets the oldest chunk pinned takes the next one.
    sidecar = sidecar_factory(overrides={"l2": {"enabled": False}}).start()
    client = sidecar.client(kv_events=True)
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
    tenant = sidecar.client(kv_events=True)
    kit.store(tenant, kit.make_keys(2, seed=720), NBYTES, owner="w")
    other = SidecarClient(sidecar.endpoint, OTHER_TENANT, role="scheduler", call_timeout_s=2)
    events, _ = _read_all(other)
    assert events == []
    mine, _ = _read_all(tenant)
    assert len([e for e in mine if e.tier == "l1"]) == 2
    tenant.close()
    other.close()


def test_nothing_is_recorded_until_a_client_asks_for_events(sidecar: Any, kit: Any):
    """No vLLM publishes events: stores and evictions are not journaled (the
    store path pays nothing). The first reader turns recording on, from then
    on; a HELLO with ``kv_events`` does so before its client's first store."""
    quiet = sidecar.client()
    keys = kit.make_keys(4, seed=730)
    assert kit.store(quiet, keys[:2], NBYTES, owner="w") == 2
    reader = sidecar.client(role="scheduler")
    events, last = _read_all(reader)
    # (The L2 copies of those two may still land after the read armed it.)
    assert [e for e in events if e.tier == "l1"] == []
    assert kit.store(quiet, keys[2:3], NBYTES, owner="w") == 1
    events, last = _read_all(reader, last)
    assert [(e.tier, e.kind, bytes(e.key)) for e in events if e.tier == "l1"] == [
        ("l1", "stored", bytes(keys[2]))
    ]
    quiet.close()
    reader.close()

    sidecar.restart()  # a new sidecar: recording is off again
    asking = sidecar.client(kv_events=True)
    assert kit.store(asking, keys[3:], NBYTES, owner="w") == 1
    events, _ = _read_all(asking)
    assert ("l1", "stored", bytes(keys[3])) in [(e.tier, e.kind, bytes(e.key)) for e in events]
    asking.close()


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


class _Request:
    """The few fields of a vLLM request the event feed reads (data only)."""

    def __init__(self, tokens: list[int], block: int) -> None:
        import hashlib

        self.request_id = "r"
        self.all_token_ids = tokens
        self.lora_request = None
        self.block_hashes, parent = [], b""
        for start in range(0, len(tokens) - block + 1, block):
            parent = hashlib.sha256(parent + repr(tokens[start : start + block]).encode()).digest()
            self.block_hashes.append(parent)


def test_the_feed_turns_records_into_vllm_events_and_follows_a_restarted_sidecar(
    sidecar: Any, kit: Any
):
    """KVEventFeed over a real sidecar: described chunks become BlockStored
    events of their blocks, each once; after a restart (a new journal,
    numbered from 1 again) the feed reads the new journal from its start and
    misses nothing. Only the feed's own reader thread polls, as in vLLM."""
    pytest.importorskip("vllm", reason="the event classes are vLLM's")
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash as as_vllm

    from kvstrata.connector.events import KVEventFeed

    block, bpc = 16, 1  # the test namespace: chunk_size 16 = one block
    feed = KVEventFeed(sidecar.client(role="scheduler"), block, poll_interval_s=0.02)
    fingerprint = kit.NAMESPACE.fingerprint()
    request = _Request(list(range(100, 164)), block)  # four blocks, four chunks
    feed.registry.describe(request, fingerprint, range(4), block, bpc)
    keys = [ChunkKey(fingerprint + h) for h in request.block_hashes]
    writer = sidecar.client(kv_events=True)

    def l1_stored(expected: int) -> list[Any]:
        got: list[Any] = []

        def enough() -> bool:
            got.extend(e for e in feed.take_events() if type(e).__name__ == "BlockStored")
            return len([e for e in got if e.medium == "CPU"]) >= expected

        kit.wait_until(enough, timeout=10, what=f"{expected} L1 events")
        return [e for e in got if e.medium == "CPU"]

    assert kit.store(writer, keys[:2], NBYTES, owner="a") == 2
    first = l1_stored(2)
    assert [e.block_hashes for e in first] == [[as_vllm(h)] for h in request.block_hashes[:2]]
    assert first[1].parent_block_hash == as_vllm(request.block_hashes[0])
    assert first[0].token_ids == list(range(100, 116)) and first[0].block_size == block

    writer.close()
    sidecar.restart()  # a new journal; L2 keeps the first two chunks
    writer = sidecar.client(kv_events=True)
    assert kit.store(writer, keys[2:], NBYTES, owner="b") == 2
    after = l1_stored(2)
    assert [e.block_hashes for e in after] == [[as_vllm(h)] for h in request.block_hashes[2:]]
    writer.close()
    feed.close()


class _GatedEventsClient:
    """A double around the real client: once armed, each EVENTS call waits at
    a two-party barrier before it goes to the sidecar, so two polls that can
    run at once both ask from the same cursor. Polls that run one at a time
    never meet there: the first waits out the barrier's timeout (which
    breaks it for good) and both go on in turn."""

    def __init__(self, client: SidecarClient) -> None:
        self.client = client
        self.cursors: list[int] = []  # ``after`` of every EVENTS call, in order
        self.answered = 0
        self._barrier: threading.Barrier | None = None
        self._one_call = threading.Lock()  # the real client is one socket

    def arm(self) -> None:
        self._barrier = threading.Barrier(2, timeout=1.0)

    def events(self, after: int, **kwargs: Any) -> Any:
        self.cursors.append(after)
        if self._barrier is not None:
            with contextlib.suppress(threading.BrokenBarrierError):
                self._barrier.wait()
        with self._one_call:
            reply = self.client.events(after, **kwargs)
        self.answered += 1
        return reply

    def close(self) -> None:
        self.client.close()


def test_two_polls_at_once_turn_each_record_into_one_event(sidecar: Any, kit: Any):
    """poll_once beside the feed's reader thread (or another caller) reads
    each record once: polls are serialised, so the second starts from the
    cursor the first left. Without that both read the same cursor and every
    event arrives twice."""
    pytest.importorskip("vllm", reason="the event classes are vLLM's")
    from kvstrata.connector.events import KVEventFeed

    block, bpc = 16, 1
    gated = _GatedEventsClient(sidecar.client(role="scheduler"))
    feed = KVEventFeed(gated, block, poll_interval_s=3600)  # type: ignore[arg-type]
    # The reader thread's first poll (of an empty journal) is over; it now
    # sleeps for the hour, so the polls below are the only ones.
    kit.wait_until(lambda: gated.answered >= 1, timeout=10, what="the reader's first poll")
    request = _Request(list(range(200, 232)), block)  # two chunks
    fingerprint = kit.NAMESPACE.fingerprint()
    feed.registry.describe(request, fingerprint, range(2), block, bpc)
    writer = sidecar.client(kv_events=True)
    keys = [ChunkKey(fingerprint + h) for h in request.block_hashes]
    assert kit.store(writer, keys, NBYTES, owner="w") == 2

    gated.arm()
    calls_before = len(gated.cursors)
    pollers = [threading.Thread(target=feed.poll_once) for _ in range(2)]
    for t in pollers:
        t.start()
    for t in pollers:
        t.join()
    stored = [e for e in feed.take_events() if type(e).__name__ == "BlockStored"]
    l1 = [tuple(e.block_hashes) for e in stored if e.medium == "CPU"]
    assert len(l1) == len(set(l1)) == 2, l1  # each chunk once
    second_cursor = gated.cursors[calls_before + 1]
    assert (
        second_cursor > gated.cursors[calls_before]
    )  # the second poll began where the first ended
    writer.close()
    feed.close()
