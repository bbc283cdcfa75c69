"""The benchmarks' fairness rules: equal bindings or no ratio, A B A B order."""

from __future__ import annotations

import os
import subprocess
import sys

from kvstrata.bench import e2e
from kvstrata.bench.fairness import REFUSED, bindings_equal, interleaved

ONE = {"cpus": [0, 1], "torch_threads": 2, "torch_interop_threads": 2, "OMP_NUM_THREADS": "2"}
OTHER = {**ONE, "cpus": [0], "torch_threads": 1}


def test_bindings_equal_needs_every_binding_read_and_the_same() -> None:
    assert bindings_equal([ONE, dict(ONE)])
    assert not bindings_equal([ONE, OTHER])
    assert not bindings_equal([ONE, None])
    assert not bindings_equal([])


def test_systems_alternate_run_by_run() -> None:
    assert interleaved(("vllm", "kvstrata"), 3) == [
        (0, "vllm"), (0, "kvstrata"), (1, "vllm"), (1, "kvstrata"), (2, "vllm"), (2, "kvstrata"),
    ]  # fmt: skip


def _pinned_threads(env: dict[str, str]) -> str:
    code = (
        "import os; from kvstrata.bench.fairness import pin_in_process_threads;"
        "pin_in_process_threads(); print(os.environ['OMP_NUM_THREADS'])"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return done.stdout.strip()


def test_threads_are_pinned_to_the_cpus_the_process_may_use_unless_set_outside() -> None:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    assert _pinned_threads(env) == str(len(os.sched_getaffinity(0)))
    assert _pinned_threads({**env, "OMP_NUM_THREADS": "3"}) == "3"


def _samples(runs: int) -> dict:
    """Synthetic per-request samples of ``runs`` runs (two prompts each)."""
    timed = (
        "cold", "cold_with_connector", "l1_hit", "l2_hit", "vllm_prefix_cache_hit",
        "warm_start_valkey", "warm_start_s3", "odd_l1_hit", "odd_vllm_prefix_cache_hit",
        "save_seconds_per_cold_request", "load_seconds_per_l1_hit",
    )  # fmt: skip
    samples: dict = {k: [1.0, 0.5] * runs for k in timed}
    samples |= {k: [256] * runs for k in ("hit_tokens_l1", "hit_tokens_l2")}
    samples["odd_hit_tokens_per_request"] = [992] * runs
    for k in ("cold_outputs", "odd_outputs", "odd_hit_outputs"):
        samples[k] = [[7], [8]] * runs
    for b in e2e.WARM_START_BACKENDS:
        samples[f"warm_start_{b}_outputs"] = [[7], [8]] * runs
        samples[f"warm_start_{b}_hit_tokens"] = [{b: 2048}] * runs
    samples["odd_tokens"] = 1000
    return samples


def test_e2e_gives_no_ratio_when_an_engine_ran_on_other_cpus() -> None:
    bindings = {"vllm": [ONE], "kvstrata": [OTHER, OTHER, OTHER]}
    result = e2e._result(_samples(1), bindings, prefix_tokens=1024, reps=2, runs=1)
    assert result["ratios"] is None and result["targets"] is None
    assert result["ratio_refused"] == REFUSED
    table = e2e.format_table(result)
    assert "x cold" not in table and REFUSED in table


def test_e2e_compares_when_every_engine_had_the_same_binding() -> None:
    bindings = {"vllm": [ONE] * 2, "kvstrata": [ONE] * 6}
    result = e2e._result(_samples(2), bindings, prefix_tokens=1024, reps=2, runs=2)
    assert result["bindings_equal"] and "ratio_refused" not in result
    assert result["ratios"]["l1_hit_vs_cold"] == 1.0  # the same synthetic samples
    assert "x cold" in e2e.format_table(result)
