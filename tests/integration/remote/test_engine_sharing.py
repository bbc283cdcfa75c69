"""Two engines in two OS processes share chunks through the shared tier.

Each process builds its own ``StorageManager(config, shared_tier=
build_shared_tier(config.shared))`` with L2 off: one stores a prompt's
chunks (they flow to the shared tier behind the write-behind queue), the
other starts with an empty L1, finds them by lookup and reads the same bytes.
A different namespace or a different ``cache_salt`` never hits them.
"""

from __future__ import annotations

import json
import subprocess
import sys

from kvstrata.sidecar.tiers.factory import build_shared_tier

CHILD = r"""
import hashlib, json, sys
from kvstrata.sidecar.config import config_from_dict
from kvstrata.sidecar.engine import StorageManager
from kvstrata.sidecar.keys import BlockHasher, Namespace, chunk_keys_from_block_hashes
from kvstrata.sidecar.objformat import ChunkMeta
from kvstrata.sidecar.tiers.factory import build_shared_tier

job = json.loads(sys.argv[1])
config = config_from_dict({
    "chunk_size": 64,
    "l1": {"size_bytes": "8Mi", "pin_memory": False},  # no CUDA here: skip importing torch
    "l2": {"enabled": False},
    "shared": job["shared"],
})
engine = StorageManager(config, shared_tier=build_shared_tier(config.shared))
fp = Namespace(**job["namespace"]).fingerprint()
hashes = BlockHasher(block_size=16).hash_blocks(job["tokens"], cache_salt=job["cache_salt"])
keys = chunk_keys_from_block_hashes(fp, hashes, blocks_per_chunk=4)
def payload(key):
    return b"".join(hashlib.sha256(key + bytes([i])).digest() for i in range(128))
out = {}
try:
    if job["mode"] == "store":
        out["stored"] = [engine.put(k, payload(k), ChunkMeta("uint8", (4096,))) for k in keys]
        out["flushed"] = engine.flush(timeout=20)
    else:
        result = engine.lookup(keys)
        out["hit_chunks"] = result.hit_chunks
        out["tiers"] = list(result.tiers)
        got = [engine.get(k) for k in keys]
        out["intact"] = [g is not None and bytes(g) == payload(k) for g, k in zip(got, keys)]
finally:
    engine.close()
print(json.dumps(out))
"""

TOKENS = list(range(5000, 5000 + 64 * 3))  # three chunks of four 16-token blocks


def run_engine(shared: dict, mode: str, model: str = "m", cache_salt: str = "") -> dict:
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
        timeout=90,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_fresh_engine_in_another_process_hits_through_the_shared_tier(
    shared_backend,
) -> None:
    backend = shared_backend
    config = backend.make_config(lookup_timeout_seconds=2.0)
    shared = config.model_dump(mode="json")
    backend.tiers.append(build_shared_tier(config))  # the fixture clears it at teardown

    stored = run_engine(shared, "store")
    assert stored == {"stored": [True] * 3, "flushed": True}

    reader = run_engine(shared, "probe")
    assert reader["hit_chunks"] == 3
    assert reader["tiers"] == [backend.tier_name] * 3
    assert reader["intact"] == [True] * 3


def test_other_namespaces_and_tenants_never_hit_each_others_chunks(shared_backend) -> None:
    config = shared_backend.make_config(lookup_timeout_seconds=2.0)
    shared = config.model_dump(mode="json")
    shared_backend.tiers.append(build_shared_tier(config))
    assert run_engine(shared, "store", cache_salt="tenant-a")["flushed"]

    for model, salt in (("m", "tenant-b"), ("m", ""), ("another-model", "tenant-a")):
        probe = run_engine(shared, "probe", model=model, cache_salt=salt)
        assert probe["hit_chunks"] == 0, (model, salt)
        assert probe["intact"] == [False] * 3
    assert run_engine(shared, "probe", cache_salt="tenant-a")["hit_chunks"] == 3
