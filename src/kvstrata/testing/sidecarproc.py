"""A ``kvstrata sidecar`` child process with its own config, for one machine.

Used by ``kvstrata demo``, ``kvstrata bench e2e`` and the test suites that
run a real sidecar. Everything lives under the ``root`` directory given::

    sidecar.yaml     the config (an ``ipc://`` endpoint and L2 directory here,
                     a free loopback HTTP port)
    sidecar.sock     the ZeroMQ endpoint
    sidecar.log      the process's output (appended across restarts)
    l2/              the L2 chunk files (survive a restart)

The process can be started (readiness is polled on ``/readyz`` with a
deadline), stopped with SIGTERM, killed, paused and resumed; the L1 arena
shared-memory segments it created are tracked so that they can be unlinked
after a kill, which leaves them behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from kvstrata.testing.poll import wait_until
from kvstrata.testing.servers import free_port

SIDECAR_COMMAND = [sys.executable, "-m", "kvstrata", "sidecar"]

_P = TypeVar("_P", bound="SidecarProcess")


class SidecarProcess:
    """One ``kvstrata sidecar`` child process; restartable on the same endpoint.

    Subclasses tune the class attributes: ``error`` is the exception type
    raised when the process dies while starting, does not become ready, or
    (with ``strict_stop``) ignores SIGTERM until ``stop_timeout_s``.
    """

    error: type[Exception] = RuntimeError
    start_timeout_s: float = 60.0
    stop_timeout_s: float = 30.0
    strict_stop: bool = False
    extra_env: Mapping[str, str] = {}

    def __init__(
        self,
        root: Path,
        *,
        chunk_size: int,
        l1_size: str,
        l2_size: str,
        log_level: str | None = None,
        overrides: Mapping[str, Any] | None = None,
    ) -> None:
        import yaml

        root.mkdir(parents=True, exist_ok=True)
        self.root = root
        self.http_port = free_port()
        self.endpoint = f"ipc://{root}/sidecar.sock"
        config: dict[str, Any] = {
            "chunk_size": chunk_size,
            "l1": {"size_bytes": l1_size},
            "l2": {"enabled": True, "path": str(root / "l2"), "size_bytes": l2_size},
            "server": {
                "endpoint": self.endpoint,
                "http_host": "127.0.0.1",
                "http_port": self.http_port,
                "status_detail": True,  # loopback only: tests and the demo read clients
            },
        }
        if log_level is not None:
            config["log_level"] = log_level
        for section, values in (overrides or {}).items():  # a dict merges into its section
            if isinstance(values, dict):
                config.setdefault(section, {}).update(values)
            else:
                config[section] = values
        self.config_path = root / "sidecar.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.log_path = root / "sidecar.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.arena_names: set[str] = set()

    # -- process control ----------------------------------------------------

    def command(self) -> list[str]:
        """The argv that runs ``kvstrata sidecar`` (``--config FILE`` is appended);
        a subclass runs it elsewhere, e.g. inside a container image."""
        return list(SIDECAR_COMMAND)

    def running(self) -> bool:
        """Whether the process was started and has not exited."""
        return self.proc is not None and self.proc.poll() is None

    def start(self: _P, timeout: float | None = None) -> _P:
        """Spawn the process (without ``KVSTRATA_*`` environment overrides) and
        wait for ``/readyz``; ``timeout`` defaults to ``start_timeout_s``."""
        env = {**os.environ, **self.extra_env}
        env = {k: v for k, v in env.items() if not k.startswith("KVSTRATA_")}
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [*self.command(), "--config", str(self.config_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        wait_until(
            self._ready,
            self.start_timeout_s if timeout is None else timeout,
            f"sidecar ready (log {self.log_path})",
            error=self.error,
        )
        self.arena_names.add(self.status()["arena"]["name"])
        return self

    def ensure_running(self) -> None:
        """Start the process again if it is not running."""
        if not self.running():
            self.start()

    def restart(self: _P) -> _P:
        """Stop (SIGTERM) and start again on the same endpoint and L2 directory."""
        self.stop()
        return self.start()

    def _ready(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise self.error(f"sidecar exited {self.proc.returncode}: {self.log()}")
        try:
            with urllib.request.urlopen(self.url("/readyz"), timeout=1) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def stop(self) -> int | None:
        """SIGTERM and wait up to ``stop_timeout_s``, then SIGKILL; the exit code
        (``None`` if never started). With ``strict_stop`` a sidecar that had
        to be killed raises ``error``."""
        if self.proc is None:
            return None
        if self.proc.poll() is not None:
            return self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            if self.strict_stop:
                raise self.error(f"sidecar ignored SIGTERM: {self.log()}") from None
            return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL and wait (a no-op when not running)."""
        if self.running():
            assert self.proc is not None
            self.proc.kill()
            self.proc.wait()

    def pause(self) -> None:
        """SIGSTOP: the process holds its socket but answers nothing."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def remove_arenas(self) -> None:
        """Unlink the arena segments this process created (a killed sidecar
        cannot unlink its own) and forget them."""
        for name in self.arena_names:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"/dev/shm/{name}")
        self.arena_names.clear()

    def cleanup(self) -> None:
        """Stop the process (SIGTERM, SIGKILL at the deadline) and unlink its
        arena segments."""
        self.stop()
        self.remove_arenas()

    # -- observation ----------------------------------------------------------

    def url(self, path: str) -> str:
        """``http://127.0.0.1:PORT`` + ``path`` on the sidecar's HTTP server."""
        return f"http://127.0.0.1:{self.http_port}{path}"

    def get(self, path: str) -> str:
        """The body of a GET of ``path`` on the sidecar's HTTP server."""
        with urllib.request.urlopen(self.url(path), timeout=5) as resp:
            return str(resp.read().decode())

    def samples(self) -> dict[str, float]:
        """``/metrics`` as ``name{labels}`` (as the text has it) -> value."""
        samples = {}
        for line in self.get("/metrics").splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                samples[name] = float(value)
        return samples

    def metric(self, name: str, default: float | None = None, **labels: str) -> float:
        """The sum of ``name``'s samples on ``/metrics`` whose labels include
        ``labels`` (``kvstrata_tenant_bytes``, ``tenant="a"``, ``tier="l1"``).

        With no such sample: ``default`` when given (a counter not yet
        incremented has no labelled series), else an AssertionError naming it.
        """
        from prometheus_client.parser import text_string_to_metric_families

        found = [
            sample.value
            for family in text_string_to_metric_families(self.get("/metrics"))
            for sample in family.samples
            if sample.name == name and labels.items() <= sample.labels.items()
        ]
        if not found:
            if default is not None:
                return default
            raise AssertionError(f"/metrics has no {name} with labels {labels}")
        return float(sum(found))

    def status(self) -> dict[str, Any]:
        """``/status`` as a dict."""
        return dict(json.loads(self.get("/status")))

    def log(self) -> str:
        """The last 4000 characters of the process's output."""
        return self.log_path.read_text(errors="replace")[-4000:]
