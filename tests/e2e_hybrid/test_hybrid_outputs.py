"""A hybrid model (Gemma-2: sliding-window + full-attention KV cache groups)
keeps vLLM's hybrid allocator with the connector, hits, and its greedy
outputs equal vLLM's without the connector: from L1, and from L2 after a
sidecar restart. Every prompt is several chunks longer than the window, so
the sliding-window group's blocks before the window are vLLM's null block
when a hit is loaded."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from kvstrata.testing.faults import flip_last_byte

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

_THROWAWAY_SEEDS = itertools.count(10_000)  # new prompts: each one saves, never loads


def test_the_connector_keeps_both_kv_cache_groups(
    hybrid_llm: Any, hybrid_reference: dict, kit: Any
) -> None:
    groups = kit.kv_groups(hybrid_llm)
    assert groups == ["SlidingWindowSpec", "FullAttentionSpec"]
    assert groups == hybrid_reference["groups"]
    assert not hybrid_llm.llm_engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager


def test_repeated_long_prompts_hit_every_whole_chunk_from_l1_and_match(
    hybrid_llm: Any, hybrid_reference: dict, kit: Any
) -> None:
    prompts, expected = kit.WORKLOADS["l1"], hybrid_reference["outputs"]["l1"]
    counters = kit.Counters(hybrid_llm)
    before = counters.snapshot()
    assert kit.generate(hybrid_llm, prompts) == expected  # misses; saves both groups
    d = counters.delta(before)
    assert d["hit_tokens"] == 0, d
    whole_chunks = sum(len(p) // kit.CHUNK for p in prompts)
    assert d["saved_chunks"] == 2 * whole_chunks, d  # one object per (chunk, group)
    assert d["window_skipped_saves"] == 0, d

    before = counters.snapshot()
    assert kit.generate(hybrid_llm, prompts) == expected
    d = counters.delta(before)
    hit = sum(kit.whole_chunk_hit(p) for p in prompts)
    assert d["hit_tokens"] == d["hit_tokens_l1"] == hit, d
    assert d["failed_chunks"] == 0, d
    # Full attention loads every hit chunk; the sliding window only those
    # with a block inside the window before the hit end (one chunk here).
    assert d["loaded_chunks"] == hit // kit.CHUNK + len(prompts), d


def test_prompts_sharing_a_prefix_load_it_and_match(
    hybrid_llm: Any, hybrid_reference: dict, kit: Any
) -> None:
    prompts, expected = kit.WORKLOADS["shared_prefix"], hybrid_reference["outputs"]["shared_prefix"]
    counters = kit.Counters(hybrid_llm)
    assert kit.generate(hybrid_llm, prompts[:1]) == expected[:1]
    before = counters.snapshot()
    assert kit.generate(hybrid_llm, prompts[1:]) == expected[1:]
    d = counters.delta(before)
    assert d["hit_tokens"] == (330 // kit.CHUNK) * kit.CHUNK * (len(prompts) - 1), d
    assert d["failed_chunks"] == 0, d


def test_after_a_sidecar_restart_hits_come_from_l2_and_match(
    hybrid_llm: Any, hybrid_sidecar: Any, hybrid_reference: dict, kit: Any
) -> None:
    prompts, expected = kit.WORKLOADS["l2"], hybrid_reference["outputs"]["l2"]
    counters = kit.Counters(hybrid_llm)
    assert kit.generate(hybrid_llm, prompts) == expected  # stores in L1 and L2
    hybrid_sidecar.stop()  # SIGTERM: write-behind into L2 is flushed
    hybrid_sidecar.start()  # a new, empty L1; the same L2 directory
    _reconnect(hybrid_llm, counters, kit)
    before = counters.snapshot()
    assert kit.generate(hybrid_llm, prompts) == expected
    d = counters.delta(before)
    hit = sum(kit.whole_chunk_hit(p) for p in prompts)
    assert d["hit_tokens"] == d["hit_tokens_l2"] == hit, d
    assert d["failed_chunks"] == 0, d
    assert d["async_loads"] == len(prompts), d  # a hybrid model always loads in the background


def test_a_failed_load_is_recomputed_whole_and_the_engine_keeps_serving(
    hybrid_llm: Any, hybrid_sidecar: Any, hybrid_reference: dict, kit: Any
) -> None:
    """The prompt's L2 objects corrupted behind the sidecar's back: the lookup
    finds them, their loads fail the checksum. With several KV cache groups
    vLLM takes no block-level load errors (its scheduler raises on them); the
    connector reports the request as a failed receive and vLLM recomputes it
    whole: the output still matches, the request is not asked to load again,
    and the engine keeps serving."""
    prompts, expected = kit.WORKLOADS["load_failure"], hybrid_reference["outputs"]["load_failure"]
    counters = kit.Counters(hybrid_llm)
    l2 = hybrid_sidecar.root / "l2"
    old = set(l2.rglob("*.kvs"))
    assert kit.generate(hybrid_llm, prompts) == expected  # stored
    hybrid_sidecar.stop()  # SIGTERM: write-behind into L2 is flushed
    new = set(l2.rglob("*.kvs")) - old
    assert len(new) == 2 * (len(prompts[0]) // kit.CHUNK), new  # one per (chunk, group)
    for path in new:
        flip_last_byte(path)
    hybrid_sidecar.start()  # an empty L1; L2 re-indexed from the (intact) headers
    _reconnect(hybrid_llm, counters, kit)
    before = counters.snapshot()
    assert kit.generate(hybrid_llm, prompts) == expected
    d = counters.delta(before)
    assert d["async_loads"] == 1 and d["failed_chunks"] > 0, d
    assert d["hit_tokens"] == kit.whole_chunk_hit(prompts[0]), d  # planned once, not again
    assert kit.generate(hybrid_llm, kit.WORKLOADS["l1"]) == hybrid_reference["outputs"]["l1"]


def _reconnect(llm: Any, counters: Any, kit: Any) -> None:
    """Throwaway prompts until both roles reach the restarted sidecar."""

    def reconnected() -> bool:
        before = counters.snapshot()
        kit.generate(llm, [kit.tokens(kit.CHUNK + 16, next(_THROWAWAY_SEEDS))])
        d = counters.delta(before)
        return d["lookup_failures"] == 0 and d["save_dropped_chunks"] == 0

    kit.wait_until(reconnected, 30, "the connector to reach the sidecar", step=0.1)
