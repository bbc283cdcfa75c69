"""The sidecar's logs: JSON lines with request ids, and no line per hit under load."""

from __future__ import annotations

import json
from typing import Any

from kvstrata.sidecar.keys import ChunkKey, Namespace

HITS = 10_000
CHUNKS_PER_LOOKUP = 50


def test_json_logs_name_the_request_a_refusal_belongs_to(sidecar_factory: Any, kit: Any):
    sidecar = sidecar_factory("json", {"log_format": "json", "log_level": "DEBUG"}).start()
    client = sidecar.client()
    other = Namespace(model="someone-else", block_size=16, chunk_size=16).fingerprint()
    foreign = [ChunkKey(other + b"\x07" * 32)]
    assert client.lookup(foreign, prefetch=False, owner="r") is None  # refused: bad_request
    client.close()
    sidecar.stop()
    records = [json.loads(line) for line in sidecar.log().splitlines() if line.strip()]
    refusals = [r for r in records if r.get("op") == "LOOKUP" and "bad_request" in r["msg"]]
    assert refusals, records[-10:]
    (refusal, *_) = refusals
    assert refusal["level"] == "DEBUG"
    assert refusal["client_id"] == client.client_id
    assert isinstance(refusal["request_id"], int) and refusal["request_id"] > 0


def test_ten_thousand_hits_write_no_line_each(sidecar: Any, kit: Any):
    client = sidecar.client()
    keys = kit.make_keys(CHUNKS_PER_LOOKUP, seed=91)
    assert kit.store(client, keys, 4096, owner="w") == CHUNKS_PER_LOOKUP
    before = len(sidecar.log().splitlines())
    hits = 0
    while hits < HITS:
        reply = client.lookup(keys, prefetch=False, owner="r")
        assert reply is not None
        hits += reply.hit_chunks
    kit.retrieve(client, keys, owner="r")
    client.close()
    after = len(sidecar.log().splitlines())
    assert hits >= HITS
    assert after - before <= 5, sidecar.log().splitlines()[before:][:20]
