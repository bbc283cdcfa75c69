"""The connector under sidecar restarts, a kill mid-run, and corrupted bytes.

Restarts and kills must never change an output or stop vLLM: a sidecar that
is gone costs misses and dropped saves, and hits come back after it
returns. The last test is the negative control: bytes altered in the
shared arena behind the sidecar's back must show up as different outputs,
which proves the equality checks of this suite can fail.
"""

from __future__ import annotations

import mmap
import os
import threading
from typing import Any

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_after_a_sidecar_restart_hits_come_from_disk_and_outputs_match(
    cached_llm: Any, live_sidecar: Any, counters: Any, reference: dict, kit: Any
) -> None:
    prompts = kit.WORKLOADS["restart"]
    assert kit.generate(cached_llm, prompts) == reference["restart"]  # stores in L1 and L2
    live_sidecar.stop()  # SIGTERM: write-behind into L2 is flushed
    live_sidecar.start()  # a new, empty L1 arena; the same L2 directory
    kit.reconnect(cached_llm, counters)
    before = counters.snapshot()
    assert kit.generate(cached_llm, prompts) == reference["restart"]
    d = kit.delta(before, counters.snapshot())
    assert d["hit_tokens_l2"] > 0, d
    assert d["failed_chunks"] == 0, d


def test_a_sidecar_killed_mid_run_leaves_outputs_correct_and_hits_resume(
    cached_llm: Any, live_sidecar: Any, counters: Any, reference: dict, kit: Any
) -> None:
    prompts = kit.WORKLOADS["killed"]
    start = counters.snapshot()["saved_chunks"]

    def kill_after_first_saves() -> None:
        kit.wait_until(lambda: counters.snapshot()["saved_chunks"] >= start + 5, 60, "first saves")
        live_sidecar.kill()

    killer = threading.Thread(target=kill_after_first_saves, daemon=True)
    killer.start()
    assert kit.generate(cached_llm, prompts) == reference["killed"]
    killer.join(timeout=60)
    assert not live_sidecar.running()

    # Down: every request still completes with the right tokens.
    before = counters.snapshot()
    assert kit.generate(cached_llm, prompts) == reference["killed"]
    assert kit.delta(before, counters.snapshot())["hit_tokens"] == 0

    live_sidecar.start()

    def hits_again() -> bool:
        before = counters.snapshot()
        assert kit.generate(cached_llm, prompts[:2]) == reference["killed"][:2]
        return kit.delta(before, counters.snapshot())["hit_tokens"] > 0

    kit.wait_until(hits_again, 30, "hits after the sidecar came back", step=0.2)


@pytest.mark.timeout(300)
def test_a_stalled_sidecar_costs_misses_within_the_deadline_not_a_hang(
    cached_llm: Any, live_sidecar: Any, counters: Any, reference: dict, kit: Any
) -> None:
    """The calls to a stopped sidecar end by their deadline (counted as
    timeouts, then answered from the back-off window): generation goes on
    with misses. A call that waited for the sidecar would hang the engine
    until pytest-timeout ends the test."""
    prompts = kit.WORKLOADS["stalled"]
    errors_before = counters.scheduler_client_errors()
    live_sidecar.pause()
    try:
        before = counters.snapshot()
        assert kit.generate(cached_llm, prompts) == reference["stalled"]
        d = kit.delta(before, counters.snapshot())
        errors = counters.scheduler_client_errors()
    finally:
        live_sidecar.resume()
    assert d["hit_tokens"] == 0 and d["lookup_failures"] > 0, d
    grew = {k: n - errors_before.get(k, 0) for k, n in errors.items()}
    assert grew.get("timeout", 0) >= 1, grew  # the deadline ended the lookup
    assert {k for k, n in grew.items() if n} <= {"timeout", "backoff"}, grew
    kit.reconnect(cached_llm, counters)


def test_bytes_flipped_in_the_arena_change_the_outputs(
    cached_llm: Any, live_sidecar: Any, counters: Any, reference: dict, kit: Any
) -> None:
    """Negative control: the comparison catches KV bytes that are wrong."""
    prompts = kit.WORKLOADS["corrupted"]
    kit.reconnect(cached_llm, counters)  # both roles connected: the prompt is stored
    assert kit.generate(cached_llm, prompts) == reference["corrupted"]  # stored
    corrupt_arena(live_sidecar.status()["arena"]["name"])
    before = counters.snapshot()
    outputs = kit.generate(cached_llm, prompts)
    d = kit.delta(before, counters.snapshot())
    assert d["loaded_chunks"] > 0, (
        f"{d} {counters.scheduler} {counters.worker} {counters.worker_client_errors()}"
        f" {live_sidecar.status()}"
    )
    assert outputs != reference["corrupted"]
    # Restart the sidecar (fresh arena) so later tests see clean L1 bytes.
    live_sidecar.stop()


def corrupt_arena(name: str) -> None:
    """Flip the sign bit of every float32 in the sidecar's L1 segment.

    A fault the sidecar cannot cause by itself: it writes the mapped
    segment directly, behind the sidecar's back.
    """
    import torch

    fd = os.open(f"/dev/shm/{name}", os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        with mmap.mmap(fd, size) as mm:
            view = torch.frombuffer(mm, dtype=torch.int32)
            view.bitwise_xor_(torch.tensor(-(2**31), dtype=torch.int32))
            del view
    finally:
        os.close(fd)
