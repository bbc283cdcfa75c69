"""Hits reach a prompt's last full block, not only its last full chunk.

A prompt's full blocks after its last full chunk are stored as a partial
chunk (kvstrata.sidecar.partials); the next prompt with that prefix loads
the whole chunks and then the partial one. Greedy outputs stay exact for
every prompt length around a chunk boundary, from L1, from L2 after a
sidecar restart, and after a longer prompt stored the full chunk over a
partial one. (From the shared tier: test_warm_start.)
"""

from __future__ import annotations

import re
from typing import Any

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def full_blocks_below_last_token(prompt: list[int], kit: Any) -> int:
    return (len(prompt) - 1) // kit.BLOCK * kit.BLOCK


def sidecar_counter(sidecar: Any, name: str) -> float:
    match = re.search(rf"^{name} (\S+)$", sidecar.get("/metrics"), re.M)
    return float(match.group(1)) if match else 0.0


def test_every_prompt_length_past_a_chunk_boundary_hits_to_its_last_full_block(
    cached_llm: Any, live_sidecar: Any, counters: Any, reference: dict, kit: Any
) -> None:
    prompts = kit.WORKLOADS["partial_lengths"]
    want = reference["partial_lengths"]
    assert kit.generate(cached_llm, prompts) == want  # cold: stores chunks and partials
    before = counters.snapshot()
    assert kit.generate(cached_llm, prompts) == want
    d = kit.delta(before, counters.snapshot())
    # 192 + 33 and 192 + 63 tokens hit three chunks and a one-block partial;
    # 192 + 0 hits two chunks and the first block of its last (a partial too).
    assert d["hit_tokens"] == sum(full_blocks_below_last_token(p, kit) for p in prompts), d
    assert d["hit_tokens"] == 6 * 3 * kit.CHUNK + kit.BLOCK, d
    assert d["failed_chunks"] == 0, d


def test_a_longer_prompt_loads_the_partial_chunk_then_stores_the_full_one_over_it(
    cached_llm: Any, live_sidecar: Any, counters: Any, reference: dict, kit: Any
) -> None:
    base, longer, again = kit.WORKLOADS["partial_extend"]
    want = reference["partial_extend"]
    assert kit.generate(cached_llm, [base]) == want[:1]  # three chunks + a partial
    dropped = sidecar_counter(live_sidecar, "kvstrata_partial_dropped_total")
    before = counters.snapshot()
    assert kit.generate(cached_llm, [longer]) == want[1:2]
    d = kit.delta(before, counters.snapshot())
    # The shared prefix is the base prompt's 224 tokens: three chunks and a block.
    assert d["hit_tokens"] == 3 * kit.CHUNK + kit.BLOCK, d
    # Its full chunk 3 supersedes the base prompt's partial, which is dropped ...
    assert sidecar_counter(live_sidecar, "kvstrata_partial_dropped_total") == dropped + 1
    before = counters.snapshot()
    assert kit.generate(cached_llm, [again]) == want[2:]
    d = kit.delta(before, counters.snapshot())
    # ... so the base prompt again hits its three chunks, and outputs stay exact.
    assert d["hit_tokens"] == 3 * kit.CHUNK, d
    assert d["failed_chunks"] == 0, d


def test_partial_chunks_are_loaded_from_l2_after_a_sidecar_restart(
    cached_llm: Any, live_sidecar: Any, counters: Any, reference: dict, kit: Any
) -> None:
    prompts = kit.WORKLOADS["partial_restart"]
    assert kit.generate(cached_llm, prompts) == reference["partial_restart"]
    live_sidecar.stop()  # SIGTERM: write-behind into L2 is flushed
    live_sidecar.start()  # a new, empty L1 arena; the same L2 directory
    kit.reconnect(cached_llm, counters)
    before = counters.snapshot()
    assert kit.generate(cached_llm, prompts) == reference["partial_restart"]
    d = kit.delta(before, counters.snapshot())
    # 178 tokens: two chunks and one block, all from disk.
    assert d["hit_tokens_l2"] == 2 * kit.CHUNK + kit.BLOCK == d["hit_tokens"], d
    assert d["loaded_chunks"] == 3 and d["failed_chunks"] == 0, d
