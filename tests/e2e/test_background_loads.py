"""Loads from below L1 run in the background (vLLM's ``load_kv_async``).

A hit in L1 loads before the step's forward pass; a hit that must first come
up from L2 or the shared tier is loaded by the worker on a thread of its
own while vLLM parks the request and keeps serving the others, then
reported through ``get_finished``. Outputs stay equal to vLLM's without the
connector either way.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# Server-to-sidecar bytes through the slow link: each chunk of this model
# (256 KiB) takes about a second to come up from Valkey.
SLOW_LINK_BYTES_PER_S = 256 * 1024


def test_hits_in_l2_load_in_the_background_and_hits_in_l1_inline(
    cached_llm: Any, live_sidecar: Any, counters: Any, reference: dict, kit: Any
) -> None:
    prompts = kit.WORKLOADS["background_l2"]
    want = reference["background_l2"]
    assert kit.generate(cached_llm, prompts) == want  # computed and stored (L1, then L2)
    live_sidecar.restart()  # SIGTERM flushes the copies into L2; L1 starts empty
    kit.reconnect(cached_llm, counters)
    before = counters.snapshot()
    assert kit.generate(cached_llm, prompts) == want
    d = kit.delta(before, counters.snapshot())
    assert d["async_loads"] == len(prompts), d
    assert d["hit_tokens_l2"] > 0 and d["hit_tokens_l1"] == 0, d
    assert d["loaded_chunks"] > 0 and d["failed_chunks"] == 0, d
    # Promoted into L1 by those loads: now they load before the forward pass.
    before = counters.snapshot()
    assert kit.generate(cached_llm, prompts) == want
    d = kit.delta(before, counters.snapshot())
    assert d["async_loads"] == 0, d
    assert d["hit_tokens_l1"] > 0 and d["failed_chunks"] == 0, d


def test_a_slow_shared_tier_holds_up_only_its_own_request(
    cached_llm: Any,
    live_sidecar: Any,
    counters: Any,
    reference: dict,
    kit: Any,
    tmp_path: Path,
) -> None:
    """Replica B's sidecar reaches Valkey over a slow link: a prompt only Valkey
    holds takes seconds to come up, and a prompt in B's L1 sent with it is
    answered in full before the slow one produces its first token."""
    from kvstrata.testing.netfaults import FaultyLink
    from kvstrata.testing.servers import RedisServer

    slow, fast = kit.WORKLOADS["background_slow"]
    want_slow, want_fast = reference["background_slow"]
    with RedisServer(tmp_path / "valkey") as valkey, FaultyLink(valkey.port) as link:
        valkey_config = {
            "url": link.url,
            "key_prefix": f"bg-{uuid.uuid4().hex[:8]}:",
            "timeout_seconds": 8.0,  # one chunk over the slow link takes ~1 s
        }
        overrides = {
            "shared": {"backend": "valkey", "valkey": valkey_config},
            "server": {"endpoint": live_sidecar.endpoint},
        }
        live_sidecar.stop()
        try:
            a = kit.SidecarProcess(tmp_path / "a", overrides=overrides)
            a.start()
            try:
                kit.reconnect(cached_llm, counters)
                assert kit.generate(cached_llm, [slow]) == [want_slow]  # stored, into Valkey
            finally:
                a.stop()  # SIGTERM flushes the write-behind into Valkey
                a.cleanup()
            b = kit.SidecarProcess(tmp_path / "b", overrides=overrides)
            b.start()
            try:
                kit.reconnect(cached_llm, counters)
                assert kit.generate(cached_llm, [fast]) == [want_fast]  # in B's L1
                link.throttle(SLOW_LINK_BYTES_PER_S)
                before = counters.snapshot()
                run = _step_until_done(cached_llm, {"slow": slow, "fast": fast}, kit.MAX_TOKENS)
                d = kit.delta(before, counters.snapshot())
            finally:
                link.resume()
                b.stop()
                b.cleanup()
        finally:
            live_sidecar.start()
            kit.reconnect(cached_llm, counters)
    first_token, finished, outputs = run
    assert outputs == {"slow": want_slow, "fast": want_fast}
    assert d["hit_tokens_shared"] > 0 and d["hit_tokens_l1"] > 0, d
    assert d["async_loads"] == 1 and d["failed_chunks"] == 0, d
    # The link was slow (the slow request waited for it) ...
    assert first_token["slow"] > 0.5, run
    # ... and the other request never waited for it.
    assert finished["fast"] < first_token["slow"], run


def _step_until_done(
    llm: Any, prompts: dict[str, list[int]], max_tokens: int, timeout_s: float = 60.0
) -> tuple[dict[str, float], dict[str, float], dict[str, list[int]]]:
    """Run ``prompts`` together through vLLM's engine one step at a time;
    seconds from the start to each request's first token and to its end,
    and its greedy output."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    tag = uuid.uuid4().hex[:8]
    names = {f"{name}-{tag}": name for name in prompts}
    for request_id, name in names.items():
        engine.add_request(request_id, {"prompt_token_ids": prompts[name]}, params)
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    outputs: dict[str, list[int]] = {}
    started = time.monotonic()
    while engine.has_unfinished_requests():
        assert time.monotonic() - started < timeout_s, f"not done in {timeout_s} s: {done}"
        for out in engine.step():
            name = next(n for rid, n in names.items() if out.request_id.startswith(rid))
            now = time.monotonic() - started
            if out.outputs and out.outputs[0].token_ids:
                first.setdefault(name, now)
            if out.finished:
                done[name] = now
                outputs[name] = list(out.outputs[0].token_ids)
    return first, done, outputs
