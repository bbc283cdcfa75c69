"""Two separate OS processes share chunks through the real shared tier.

One process stores the chunks of a prompt; a second, fresh process (its own
interpreter, its own client, nothing in memory) finds them by recomputing
the keys from the token ids, and never finds another namespace's or another
tenant's (cache_salt) chunks.
"""

from __future__ import annotations

import json
import subprocess
import sys

from kvstrata.sidecar.tiers.factory import build_shared_tier

CHILD = r"""
import hashlib, json, sys
from kvstrata.sidecar.config import SharedConfig
from kvstrata.sidecar.keys import BlockHasher, Namespace, chunk_keys_from_block_hashes
from kvstrata.sidecar.objformat import ChunkMeta
from kvstrata.sidecar.tiers.factory import build_shared_tier

job = json.loads(sys.argv[1])
tier = build_shared_tier(SharedConfig.model_validate(job["shared"]))
fp = Namespace(**job["namespace"]).fingerprint()
hashes = BlockHasher(block_size=16).hash_blocks(job["tokens"], cache_salt=job["cache_salt"])
keys = chunk_keys_from_block_hashes(fp, hashes, blocks_per_chunk=4)
def payload(key):  # deterministic bytes, so the reader can check them
    return b"".join(hashlib.sha256(key + bytes([i])).digest() for i in range(64))
out = {"keys": len(keys)}
if job["mode"] == "store":
    out["stored"] = [tier.put(k, payload(k), ChunkMeta("uint8", (2048,))) for k in keys]
else:
    out["contains"] = tier.contains_many(keys)
    got = [tier.get(k) for k in keys]
    out["hits"] = [g is not None for g in got]
    out["intact"] = [g is not None and bytes(g.payload) == payload(k) for g, k in zip(got, keys)]
tier.close()
print(json.dumps(out))
"""

TOKENS = list(range(1000, 1000 + 64 * 3))  # three chunks of 4 blocks of 16 tokens


def run_child(shared: dict, mode: str, model: str = "m", cache_salt: str = "") -> dict:
    job = {
        "shared": shared,
        "namespace": {"model": model, "block_size": 16, "chunk_size": 64},
        "tokens": TOKENS,
        "cache_salt": cache_salt,
        "mode": mode,
    }
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(job)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_second_process_hits_what_the_first_stored_and_only_in_its_namespace(
    shared_backend,
) -> None:
    config = shared_backend.make_config(lookup_timeout_seconds=1.0)
    shared = config.model_dump(mode="json")

    stored = run_child(shared, "store")
    assert stored["stored"] == [True, True, True]

    same = run_child(shared, "probe")
    assert same["contains"] == [True] * 3
    assert same["intact"] == [True] * 3

    other_model = run_child(shared, "probe", model="another-model")
    assert other_model["contains"] == [False] * 3 and other_model["hits"] == [False] * 3

    other_tenant = run_child(shared, "probe", cache_salt="tenant-b")
    assert other_tenant["contains"] == [False] * 3 and other_tenant["hits"] == [False] * 3

    # The backend fixture clears and closes this tier (and so the prefix) at teardown.
    shared_backend.tiers.append(build_shared_tier(config))
