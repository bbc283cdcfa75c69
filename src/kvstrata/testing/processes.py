"""The long-running processes of a harness (etcd, kube-apiserver, containerd, a kubelet):
started with their output in one log file each, waited on by a readiness probe that
fails at once, with the log's tail, when the process exits, and stopped newest first;
and the one way a test stops a process it started (:func:`stop_process`).

Why this module exists: the control plane and the node each start several
daemons and must say, when one of them dies on start, what it printed;
one place does that for both.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Mapping
from pathlib import Path

from kvstrata.testing.poll import wait_until


def wait_or_kill(process: subprocess.Popen, grace: float = 20.0) -> int:
    """Wait up to ``grace`` seconds for a process asked to stop, then kill it; its exit code."""
    try:
        return process.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()


def stop_process(process: subprocess.Popen, grace: float = 20.0) -> int:
    """SIGTERM (a clean exit: an operator says farewell to its peers), then :func:`wait_or_kill`."""
    if process.poll() is None:
        process.terminate()
    return wait_or_kill(process, grace)


class ProcessSet:
    """Processes started in ``workdir``, each logging to ``workdir/NAME.log``."""

    def __init__(self, workdir: Path, error: type[Exception]) -> None:
        self.workdir = workdir
        self.error = error  # raised (with the log's tail) when a process dies on start
        self.processes: list[tuple[str, subprocess.Popen]] = []

    def spawn(
        self, name: str, args: list[str], env: Mapping[str, str] | None = None
    ) -> subprocess.Popen:
        log = (self.workdir / f"{name}.log").open("wb")
        process = subprocess.Popen(
            args,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=self.workdir,
            env=None if env is None else dict(env),
        )
        log.close()
        self.processes.append((name, process))
        return process

    def log_tail(self, name: str, size: int = 3000) -> str:
        path = self.workdir / f"{name}.log"
        return path.read_text(errors="replace")[-size:] if path.exists() else ""

    def wait(
        self, name: str, process: subprocess.Popen, ready: Callable[[], bool], timeout: float
    ) -> None:
        """Poll ``ready`` (an OSError is "not yet") until it holds; fail when the process exits."""

        def up() -> bool:
            if process.poll() is not None:
                raise self.error(f"{name} exited with {process.returncode}:\n{self.log_tail(name)}")
            try:
                return ready()
            except OSError:
                return False

        wait_until(up, timeout, f"{name} to answer", step=0.25, error=self.error)

    def stop(self) -> None:
        """Terminate the processes, newest first (a client before the server it talks to)."""
        for _, process in reversed(self.processes):
            if process.poll() is None:
                process.terminate()
        for _, process in reversed(self.processes):
            wait_or_kill(process)
        self.processes.clear()
