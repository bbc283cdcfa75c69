"""A sidecar process and a vLLM-CPU engine with the connector, on one machine.

Why: ``kvstrata demo`` and ``kvstrata bench e2e`` both need the whole stack
without Kubernetes: a ``kvstrata sidecar`` child process on its own
``ipc://`` endpoint (L1 arena, L2 in a temporary directory), and a vLLM
engine in this process configured to use ``kvstrata.connector``.

State on disk (all under the ``root`` directory the caller gives)::

    sidecar.yaml     the sidecar's config
    sidecar.sock     its ZeroMQ endpoint
    sidecar.log      its output
    l2/              its L2 chunk files (survive a restart)
"""

from __future__ import annotations

import contextlib
import os
import random
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstrata.connector.transfer_config import kv_transfer_config
from kvstrata.testing.sidecarproc import SidecarProcess

# vLLM on CPU, offline, quiet, with the engine in this process (starts in
# seconds instead of tens of seconds).
VLLM_ENV = {
    "VLLM_HOST_IP": "127.0.0.1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_CPU_KVCACHE_SPACE": "2",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "PYTHONHASHSEED": "0",
}

_HIT_RE = re.compile(r'^kvstrata_hit_tokens_total\{tier="([^"]+)"\}\s+([0-9.e+]+)', re.M)


# The same CPU binding for every engine a benchmark compares: vLLM-CPU reserves
# one more core for the scheduler process when any KV connector is configured
# (vllm/utils/ompmultiprocessing.py, reserve_cpu_num), which on a small node
# gives an engine with the connector more cores than one without.
BENCH_CPU_BINDING = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}


def set_vllm_env(quiet: bool = True) -> None:
    """Environment vLLM-CPU needs (and the benchmarks' equal CPU binding);
    call before importing vLLM."""
    for key, value in {**VLLM_ENV, **BENCH_CPU_BINDING}.items():
        os.environ.setdefault(key, value)
    if quiet:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


# The end-to-end suites: the same, with a 1 GiB KV cache (their tiny models need no more).
E2E_VLLM_ENV = {**VLLM_ENV, "VLLM_CPU_KVCACHE_SPACE": "1"}


@contextlib.contextmanager
def vllm_environment(env: Mapping[str, str] = E2E_VLLM_ENV) -> Iterator[None]:
    """``env`` set in ``os.environ`` while the block runs; restored after."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def random_tokens(n: int, seed: int) -> list[int]:
    """``n`` token ids from a fixed seed (exact prompt lengths, no tokenizer)."""
    rng = random.Random(seed)
    return [rng.randrange(10, 500) for _ in range(n)]


def greedy_outputs(llm: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy completions of token-id prompts, exactly ``max_tokens`` each."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


@dataclass
class StepwiseRun:
    """Seconds from the start to each request's first token and to its end,
    and its greedy output (by the names :func:`run_stepwise` was given)."""

    first_token_s: dict[str, float] = field(default_factory=dict)
    finished_s: dict[str, float] = field(default_factory=dict)
    # The same moments as engine step numbers (1 = the first step): what a
    # test orders requests by, since step order does not depend on load.
    first_token_step: dict[str, int] = field(default_factory=dict)
    finished_step: dict[str, int] = field(default_factory=dict)
    steps: int = 0
    outputs: dict[str, list[int]] = field(default_factory=dict)


def run_stepwise(
    llm: Any,
    prompts: Mapping[str, list[int]],
    max_tokens: int,
    timeout_s: float = 60.0,
    on_step: Callable[[StepwiseRun], None] | None = None,
) -> StepwiseRun:
    """Run ``prompts`` together through vLLM's engine one step at a time
    (``LLMEngine.add_request`` / ``step``), timing each request: what an
    online server's clients see, in this process. Each request's first token
    and finish are also recorded as step numbers; ``on_step`` is called with
    the run after every step (a test releases a gate there)."""
    import time
    import uuid

    from vllm import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    tag = uuid.uuid4().hex[:8]
    names = {f"{name}-{tag}": name for name in prompts}
    for request_id, name in names.items():
        engine.add_request(request_id, {"prompt_token_ids": prompts[name]}, params)
    run = StepwiseRun()
    started = time.monotonic()
    while engine.has_unfinished_requests():
        if time.monotonic() - started > timeout_s:
            raise TimeoutError(f"not done in {timeout_s} s: {run}")
        outputs = engine.step()
        run.steps += 1
        for out in outputs:
            # vLLM may suffix the id it was given
            name = next(n for rid, n in names.items() if out.request_id.startswith(rid))
            now = time.monotonic() - started
            if out.outputs and out.outputs[0].token_ids:
                run.first_token_s.setdefault(name, now)
                run.first_token_step.setdefault(name, run.steps)
            if out.finished:
                run.finished_s[name] = now
                run.finished_step[name] = run.steps
                run.outputs[name] = list(out.outputs[0].token_ids)
        if on_step is not None:
            on_step(run)
    return run


class LocalSidecar(SidecarProcess):
    """One ``kvstrata sidecar`` child process; restartable on the same endpoint.

    :meth:`stop` also unlinks any arena segment the process left behind.
    """

    def __init__(
        self,
        root: Path,
        *,
        chunk_size: int,
        l1_size: str = "512Mi",
        l2_size: str = "4Gi",
        overrides: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(
            root,
            chunk_size=chunk_size,
            l1_size=l1_size,
            l2_size=l2_size,
            log_level="WARNING",
            overrides=overrides,
        )

    @property
    def metrics_url(self) -> str:
        """The sidecar's Prometheus ``/metrics`` URL."""
        return self.url("/metrics")

    def stop(self) -> int | None:
        """SIGTERM (SIGKILL after ``stop_timeout_s``), then unlink arena segments."""
        code = super().stop()
        self.remove_arenas()
        return code

    def hit_tokens_by_tier(self) -> dict[str, int]:
        """``kvstrata_hit_tokens_total`` by tier, from ``/metrics``."""
        text = self.get("/metrics")
        return {tier: int(float(v)) for tier, v in _HIT_RE.findall(text)}


def tiny_engine(model: Path, transfer: Any | None, **settings: Any) -> Any:
    """A vLLM-CPU engine for a tiny local model, in float32 with vLLM's own
    prefix cache off (every hit is kvstrata's) and with the kvstrata
    connector when ``transfer`` is given; ``settings`` are further LLM
    arguments (block size, batch limits)."""
    from vllm import LLM

    if transfer is not None:
        settings["kv_transfer_config"] = transfer
    return LLM(
        model=str(model),
        dtype="float32",
        max_model_len=2048,
        enable_prefix_caching=False,
        enforce_eager=True,
        seed=0,
        **settings,
    )


def transfer_config(endpoint: str, chunk_size: int, **extra: Any) -> Any:
    """vLLM's ``KVTransferConfig`` selecting the kvstrata connector."""
    from vllm.config import KVTransferConfig

    return KVTransferConfig(**kv_transfer_config(endpoint, chunk_size=chunk_size, **extra))


_held_engines: list[Any] = []  # engines a fixture keeps for many tests (at most one)


def hold_engine(llm: Any) -> Any:
    """Record ``llm`` as the in-process engine a long-lived fixture keeps, so
    that another suite's fixture can stop it first (:func:`release_held_engine`):
    ``pytest tests/e2e tests/e2e_hybrid`` runs both suites in one process."""
    _held_engines.append(llm)
    return llm


def is_held(llm: Any) -> bool:
    """Whether ``llm`` is still running as a held engine (no one released it)."""
    return any(held is llm for held in _held_engines)


def release_held_engine() -> None:
    """Stop every engine :func:`hold_engine` recorded (before starting another)."""
    while _held_engines:
        shutdown_engine(_held_engines[-1])


def shutdown_engine(llm: Any) -> None:
    """Stop an in-process engine so another one (with or without the
    connector) can start in this process: vLLM keeps its connector global.
    Stopping one twice is harmless."""
    import gc

    with contextlib.suppress(ValueError):
        _held_engines.remove(llm)

    from vllm.distributed.kv_transfer import ensure_kv_transfer_shutdown

    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()
    ensure_kv_transfer_shutdown()
    with contextlib.suppress(Exception):
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
    gc.collect()


def connector_counters(llm: Any) -> tuple[Any, Any]:
    """The (scheduler, worker) counters of the connector in this process."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    scheduler = llm.llm_engine.engine_core.engine_core.scheduler.connector
    return scheduler.counters, get_kv_transfer_group().counters
