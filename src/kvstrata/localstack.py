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
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

SIDECAR_COMMAND = [sys.executable, "-m", "kvstrata", "sidecar"]

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


def set_vllm_env(quiet: bool = True) -> None:
    """Environment vLLM-CPU needs; call before importing vLLM."""
    for key, value in VLLM_ENV.items():
        os.environ.setdefault(key, value)
    if quiet:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalSidecar:
    """One ``kvstrata sidecar`` child process; restartable on the same endpoint."""

    def __init__(
        self, root: Path, *, chunk_size: int, l1_size: str = "512Mi", l2_size: str = "4Gi"
    ) -> None:
        import yaml

        root.mkdir(parents=True, exist_ok=True)
        self.root = root
        self.endpoint = f"ipc://{root}/sidecar.sock"
        self.http_port = free_port()
        config = {
            "chunk_size": chunk_size,
            "log_level": "WARNING",
            "l1": {"size_bytes": l1_size},
            "l2": {"enabled": True, "path": str(root / "l2"), "size_bytes": l2_size},
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

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metrics"

    def start(self, timeout: float = 60.0) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTRATA_")}
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [*SIDECAR_COMMAND, "--config", str(self.config_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        deadline = time.monotonic() + timeout
        while not self._ready():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the sidecar did not become ready; see {self.log_path}")
            time.sleep(0.05)
        with contextlib.suppress(Exception):
            self.arena_names.add(self.status()["arena"]["name"])

    def _ready(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            tail = self.log_path.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"the sidecar exited with {self.proc.returncode}:\n{tail}")
        try:
            with urllib.request.urlopen(self._url("/readyz"), timeout=1) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for name in self.arena_names:  # only left behind by a killed sidecar
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"/dev/shm/{name}")
        self.arena_names.clear()

    def _url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.http_port}{path}"

    def status(self) -> dict[str, Any]:
        import json

        with urllib.request.urlopen(self._url("/status"), timeout=5) as resp:
            return dict(json.loads(resp.read().decode()))

    def hit_tokens_by_tier(self) -> dict[str, int]:
        """``kvstrata_hit_tokens_total`` by tier, from ``/metrics``."""
        with urllib.request.urlopen(self.metrics_url, timeout=5) as resp:
            text = resp.read().decode()
        return {tier: int(float(v)) for tier, v in _HIT_RE.findall(text)}


def transfer_config(endpoint: str, chunk_size: int, **extra: Any) -> Any:
    """vLLM's ``KVTransferConfig`` selecting the kvstrata connector."""
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector="KVStrataConnector",
        kv_connector_module_path="kvstrata.connector",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"endpoint": endpoint, "chunk_size": chunk_size, **extra},
    )


def shutdown_engine(llm: Any) -> None:
    """Stop an in-process engine so another one (with or without the
    connector) can start in this process: vLLM keeps its connector global."""
    import gc

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
