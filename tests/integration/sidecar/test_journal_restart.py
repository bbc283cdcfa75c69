"""After a sidecar is killed and started again, routers hear that its L1 is
gone, and only that: the connector's event feed reads a real sidecar's
journal before and after a SIGKILL."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

from kvstrata.sidecar.keys import ChunkKey

NBYTES = 4096
BLOCK = 16  # the test namespace: chunk_size 16 = one block per chunk


class _Request:
    """The few fields of a vLLM request the event feed reads (data only)."""

    def __init__(self, tokens: list[int]) -> None:
        self.request_id = "r"
        self.all_token_ids = tokens
        self.lora_request = None
        self.block_hashes, parent = [], b""
        for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
            parent = hashlib.sha256(parent + repr(tokens[start : start + BLOCK]).encode()).digest()
            self.block_hashes.append(parent)


def test_a_killed_sidecar_s_l1_blocks_are_reported_removed_and_its_disk_blocks_are_not(
    sidecar: Any, kit: Any
):
    pytest.importorskip("vllm", reason="the event classes are vLLM's")
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash as as_vllm

    from kvstrata.connector.events import KVEventFeed

    feed = KVEventFeed(sidecar.client(role="scheduler"), BLOCK, poll_interval_s=3600)
    fingerprint = kit.NAMESPACE.fingerprint()
    request = _Request(list(range(500, 548)))  # three blocks, three chunks
    feed.registry.describe(request, fingerprint, range(3), BLOCK, 1)
    keys = [ChunkKey(fingerprint + h) for h in request.block_hashes]
    hashes = [as_vllm(h) for h in request.block_hashes]
    events: list[Any] = []

    def read_until(done: Any, what: str) -> None:
        def step() -> bool:
            while feed.poll_once():
                pass
            events.extend(feed.take_events())
            return bool(done())

        kit.wait_until(step, timeout=30, what=what)

    def stored(medium: str) -> list[Any]:
        return [h for e in events if type(e).__name__ == "BlockStored" and e.medium == medium
                for h in e.block_hashes]  # fmt: skip

    writer = sidecar.client(kv_events=True)
    assert kit.store(writer, keys[:2], NBYTES, owner="a") == 2
    read_until(lambda: len(stored("STORAGE")) == 2, "L1 and L2 events of two chunks")
    assert stored("CPU") == hashes[:2]
    before = len(events)

    sidecar.kill()  # SIGKILL: no goodbye of any kind
    sidecar.start()
    writer = sidecar.client(kv_events=True)
    assert kit.store(writer, keys[2:], NBYTES, owner="b") == 1
    read_until(lambda: hashes[2] in stored("CPU"), "the new sidecar's first store")
    # Read back from L2 into the new L1: announced in L1 again.
    assert kit.retrieve(writer, keys[:1], owner="c") == [kit.payload(keys[0], NBYTES)]
    read_until(lambda: stored("CPU").count(hashes[0]) == 2, "the promotion into L1")

    after = events[before:]
    kinds = [type(e).__name__ for e in after]
    assert "AllBlocksCleared" not in kinds  # it would clear GPU and disk blocks too
    removed = [e for e in after if type(e).__name__ == "BlockRemoved"]
    # On 4edd4cb: nothing said the old L1 was gone.
    assert [(e.medium, sorted(e.block_hashes)) for e in removed] == [("CPU", sorted(hashes[:2]))]
    # The removal comes before anything the new sidecar announces.
    assert kinds[0] == "BlockRemoved"
    writer.close()
    feed.close()
