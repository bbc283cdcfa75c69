"""Read metrics count each byte once: a lookup's prefetch and the read that
follows it are two leases on one chunk, but one read of its bytes.

The expected figures come from the test's own chunk sizes and counts, read
back from the sidecar's ``/metrics`` after a known workload."""

from __future__ import annotations

import re
from typing import Any

CHUNK = 256 << 10


def _sample(text: str, name: str, labels: str = "") -> float:
    match = re.search(rf"^{name}{re.escape(labels)} (\S+)$", text, re.MULTILINE)
    assert match is not None, f"{name}{labels} not in /metrics"
    return float(match.group(1))


def test_a_prefetched_chunk_read_once_counts_its_bytes_once(sidecar: Any, kit: Any):
    keys = kit.make_keys(6, seed=500)
    client = sidecar.client()
    assert kit.store(client, keys, CHUNK, owner="w") == 6
    scheduler = sidecar.client(role="scheduler")
    # Two requests: each looks up (with prefetch) and then reads the first 4 chunks.
    for owner in ("req-a", "req-b"):
        found = scheduler.lookup(keys[:4], prefetch=True, owner=owner)
        assert found is not None and found.hit_chunks == 4
        data = kit.retrieve(client, keys[:4], owner=owner)
        assert data == [kit.payload(k, CHUNK) for k in keys[:4]]
        assert scheduler.end_request(owner)
    # One more read without a lookup before it (no prefetch).
    assert kit.retrieve(client, keys[4:5], owner="req-c") == [kit.payload(keys[4], CHUNK)]
    text = sidecar.get("/metrics")
    read = (2 * 4 + 1) * CHUNK
    prefetched = 2 * 4 * CHUNK
    assert _sample(text, "kvstrata_retrieved_bytes_total", '{tier="l1"}') == read
    assert _sample(text, "kvstrata_prefetched_bytes_total") == prefetched
    assert _sample(text, "kvstrata_stored_bytes_total", '{tier="l1"}') == 6 * CHUNK
    client.close()
    scheduler.close()


def test_a_prefetch_from_l2_counts_the_l1_read_once(sidecar: Any, kit: Any):
    keys = kit.make_keys(3, seed=510)
    writer = sidecar.client()
    assert kit.store(writer, keys, CHUNK, owner="w") == 3
    writer.close()
    sidecar.restart()  # L1 is empty: the prefetch promotes from L2 on background threads
    client = sidecar.client()
    scheduler = sidecar.client(role="scheduler")
    found = scheduler.lookup(keys, prefetch=True, owner="req-1")
    assert found is not None and found.hit_chunks == 3

    def promoted() -> bool:
        return sidecar.status()["counters"].get("promotions_total_l2", 0) >= 3

    kit.wait_until(promoted, 10, "the prefetch finished")
    assert kit.retrieve(client, keys, owner="req-1") == [kit.payload(k, CHUNK) for k in keys]
    assert scheduler.end_request("req-1")
    text = sidecar.get("/metrics")
    assert _sample(text, "kvstrata_retrieved_bytes_total", '{tier="l1"}') == 3 * CHUNK
    assert _sample(text, "kvstrata_prefetched_bytes_total") == 3 * CHUNK
    client.close()
    scheduler.close()
