"""A new replica starts warm from the shared tier: what one pod computed, another loads.

Replica A's sidecar (with a real Valkey as the shared tier) stores a prompt's
chunks while vLLM computes them; A goes away. Replica B's sidecar starts with
an empty L1 and an empty L2 directory on the same Valkey: vLLM's first
request for that prompt loads every full chunk from the shared tier, and its
greedy output equals vLLM's without any cache. (The engine is the suite's one
connector engine, with vLLM's own prefix cache off, so every hit is the
sidecar's; ``kvstrata bench e2e`` measures the same with a brand-new vLLM.)
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_a_new_replica_loads_from_the_shared_tier_and_matches(
    cached_llm: Any,
    live_sidecar: Any,
    counters: Any,
    reference: dict,
    kit: Any,
    tmp_path: Path,
) -> None:
    from kvstrata.testing.servers import RedisServer

    prompts = kit.WORKLOADS["warm_start"]
    with RedisServer(tmp_path / "valkey") as valkey:
        shared = {
            "backend": "valkey",
            "valkey": {"url": valkey.url, "key_prefix": f"warm-{uuid.uuid4().hex[:8]}:"},
        }
        # Each replica's sidecar listens where the engine's connector connects.
        server = {"endpoint": live_sidecar.endpoint}
        live_sidecar.stop()
        try:
            _run_replicas(cached_llm, counters, reference, kit, prompts, shared, server, tmp_path)
        finally:
            live_sidecar.start()
            kit.reconnect(cached_llm, counters)


def _run_replicas(
    llm: Any,
    counters: Any,
    reference: dict,
    kit: Any,
    prompts: list[list[int]],
    shared: dict[str, Any],
    server: dict[str, Any],
    root: Path,
) -> None:
    a = kit.SidecarProcess(root / "a", overrides={"shared": shared, "server": server})
    a.start()
    try:
        kit.reconnect(llm, counters)
        assert kit.generate(llm, prompts) == reference["warm_start"]  # computed, stored
    finally:
        a.stop()  # SIGTERM: write-behind into Valkey is flushed
        a.cleanup()
    b = kit.SidecarProcess(root / "b", overrides={"shared": shared, "server": server})
    assert not any((root / "b" / "l2").rglob("*.kvs")), "replica B must start with an empty L2"
    b.start()
    try:
        kit.reconnect(llm, counters)
        before = counters.snapshot()
        assert kit.generate(llm, prompts) == reference["warm_start"]
        d = kit.delta(before, counters.snapshot())
    finally:
        b.stop()
        b.cleanup()
    # Every whole block below each prompt's last token came from Valkey: the
    # whole chunks and, after them, the partial chunk of the remaining blocks.
    blocks = sum((len(p) - 1) // kit.BLOCK for p in prompts)
    assert d["hit_tokens_shared"] == blocks * kit.BLOCK, d
    assert d["hit_tokens_l1"] == d["hit_tokens_l2"] == 0, d
    assert d["failed_chunks"] == 0, d
