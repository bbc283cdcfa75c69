"""Loads from below L1 run in the background (vLLM's ``load_kv_async``).

A hit in L1 loads before the step's forward pass; a hit that must first come
up from L2 or the shared tier is loaded by the worker on a thread of its
own while vLLM parks the request and keeps serving the others, then
reported through ``get_finished``. Outputs stay equal to vLLM's without the
connector either way.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# Replies from Valkey at least this large are chunk data (a chunk of this
# model is 256 KiB); lookups' replies are a few bytes and pass the gate.
CHUNK_REPLY_BYTES = 16 * 1024


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
    """Replica B's sidecar reaches Valkey over a link that holds chunk data
    until the test releases it: a prompt only Valkey holds cannot come up,
    and a prompt in B's L1 sent with it is answered in full meanwhile. The
    gate opens once the L1 request has finished (counted in engine steps);
    only then does the held request produce its first token. Were the held
    load to block the engine's steps, the L1 request could not finish, the
    gate would stay shut and the load would fail at its deadline."""
    from kvstrata.testing.faults import FaultyLink
    from kvstrata.testing.localstack import run_stepwise
    from kvstrata.testing.servers import RedisServer

    slow, fast = kit.WORKLOADS["background_slow"]
    want_slow, want_fast = reference["background_slow"]
    with RedisServer(tmp_path / "valkey") as valkey, FaultyLink(valkey.port) as link:
        valkey_config = {
            "url": link.url,
            "key_prefix": f"bg-{uuid.uuid4().hex[:8]}:",
            # Held at the gate while the L1 request runs (a few steps), then quick.
            "timeout_seconds": 8.0,
        }
        overrides = {
            # The lookup's EXISTS goes through the link's proxy thread: the
            # default 50 ms deadline is missed on a loaded machine, and the
            # held prompt would then not be found in Valkey at all.
            "shared": {
                "backend": "valkey",
                "valkey": valkey_config,
                "lookup_timeout_seconds": 1.5,
            },
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
                link.hold_replies(from_bytes=CHUNK_REPLY_BYTES)

                def open_gate_once_fast_is_done(run: Any) -> None:
                    if "fast" in run.finished_step:
                        link.release()

                before = counters.snapshot()
                run = run_stepwise(
                    cached_llm,
                    {"slow": slow, "fast": fast},
                    kit.MAX_TOKENS,
                    on_step=open_gate_once_fast_is_done,
                )
                d = kit.delta(before, counters.snapshot())
            finally:
                link.resume()
                b.stop()
                b.cleanup()
        finally:
            live_sidecar.start()
            kit.reconnect(cached_llm, counters)
    assert run.outputs == {"slow": want_slow, "fast": want_fast}
    assert d["hit_tokens_shared"] > 0 and d["hit_tokens_l1"] > 0, d
    assert d["async_loads"] == 1 and d["failed_chunks"] == 0, d
    # The held request's chunks did wait at the gate ...
    assert link.held_total >= 1
    # ... and the other request never waited for them: it finished in an
    # earlier engine step than the held one's first token.
    assert run.finished_step["fast"] < run.first_token_step["slow"], run
