"""Greedy outputs through the kvstrata connector equal outputs without it.

Each test runs a workload through the engine with the connector (a real
sidecar process behind it) and compares with the reference engine's
outputs for the same prompts, computed in this session. Each also checks
that the cache was actually used: hit tokens and loaded chunks grew.
"""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_repeated_prompt_hits_and_matches_the_reference(
    cached_llm: Any, live_sidecar: Any, counters: Any, reference: dict, kit: Any
) -> None:
    prompts = kit.WORKLOADS["repeated"]
    assert kit.generate(cached_llm, prompts) == reference["repeated"]  # cold: stores
    before = counters.snapshot()
    assert kit.generate(cached_llm, prompts) == reference["repeated"]
    assert kit.generate(cached_llm, prompts) == reference["repeated"]
    d = kit.delta(before, counters.snapshot())
    # 300 tokens: four whole chunks and a partial one of one block (the nine
    # full blocks below the last token), loaded twice.
    assert d["hit_tokens"] == 2 * (4 * kit.CHUNK + kit.BLOCK), d
    assert d["loaded_chunks"] == 10 and d["failed_chunks"] == 0, d


def test_prompts_sharing_a_prefix_load_the_prefix_and_match(
    cached_llm: Any, live_sidecar: Any, counters: Any, reference: dict, kit: Any
) -> None:
    prompts = kit.WORKLOADS["shared_prefix"]
    want = reference["shared_prefix"]
    assert kit.generate(cached_llm, prompts[:1]) == want[:1]
    before = counters.snapshot()
    assert kit.generate(cached_llm, prompts[1:]) == want[1:]
    d = kit.delta(before, counters.snapshot())
    # The 320-token shared prefix is five chunks; each of three prompts loads them.
    assert d["hit_tokens"] >= 3 * 5 * kit.CHUNK, d
    assert d["failed_chunks"] == 0, d


def test_mixed_batch_of_hits_misses_and_short_prompts_matches(
    cached_llm: Any, live_sidecar: Any, counters: Any, reference: dict, kit: Any
) -> None:
    kit.generate(cached_llm, kit.WORKLOADS["repeated"] + kit.WORKLOADS["shared_prefix"][:1])
    before = counters.snapshot()
    assert kit.generate(cached_llm, kit.WORKLOADS["mixed"]) == reference["mixed"]
    d = kit.delta(before, counters.snapshot())
    assert d["hit_tokens"] >= (4 + 5) * kit.CHUNK, d
    assert d["saved_chunks"] > 0, d  # the new prompts were stored
    # Again: now every prompt with a whole block before its last token hits,
    # up to that block (whole chunks, then a partial chunk of the rest).
    before = counters.snapshot()
    assert kit.generate(cached_llm, kit.WORKLOADS["mixed"]) == reference["mixed"]
    d = kit.delta(before, counters.snapshot())
    assert d["hit_tokens"] == (4 + 7 + 0 + 2 + 5 + 3) * kit.CHUNK + 4 * kit.BLOCK, d


def test_long_prompts_under_chunked_prefill_store_and_load_every_chunk(
    cached_llm: Any, live_sidecar: Any, counters: Any, reference: dict, kit: Any
) -> None:
    prompts = kit.WORKLOADS["long"]
    want = reference["long"]
    before = counters.snapshot()
    assert kit.generate(cached_llm, prompts[:1]) == want[:1]
    d = kit.delta(before, counters.snapshot())
    # 1100 tokens computed 160 at a time: all 17 whole chunks were saved.
    assert d["saved_chunks"] == 1100 // kit.CHUNK, d
    before = counters.snapshot()
    assert kit.generate(cached_llm, prompts) == want
    d = kit.delta(before, counters.snapshot())
    # The first prompt loads 17 chunks, the second shares 1000 tokens = 15 chunks.
    assert d["hit_tokens"] == (17 + 15) * kit.CHUNK, d
    assert d["failed_chunks"] == 0, d
