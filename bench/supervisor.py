"""Restart a process when it exits, with backoff, the way the kubelet restarts a container.

Why: in a pod the sidecar is a native sidecar (``restartPolicy: Always``):
after a crash the kubelet starts it again, waiting 10 s, 20 s, 40 s ... (capped,
reset after it ran long enough). The soak kills the sidecar and must see the
same: a new process on the same endpoint, while vLLM keeps serving. The delays
here are the kubelet's shape scaled down for a soak of minutes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from kvstrata.testing.sidecarproc import SidecarProcess

BACKOFF_S = (0.5, 1.0, 2.0, 4.0)
RESET_AFTER_S = 10.0  # a process that ran this long starts the backoff from the beginning


class Supervisor:
    """Watches ``process``; restarts it after it exits unless :meth:`hold` is in effect."""

    def __init__(self, process: SidecarProcess, on_start: Callable[[], None] | None = None) -> None:
        self.process = process
        self.restarts = 0
        # The exit status of every exit it did not ask for (a planned stop is
        # held), oldest first: -N for signal N (subprocess's convention).
        self.exits: list[int] = []
        self._recorded: object = None  # the process whose exit is in ``exits`` already
        self.failed_starts = 0
        self._on_start = on_start
        self._held = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()  # one start at a time (the watcher's or the soak's)
        self._thread = threading.Thread(target=self._watch, daemon=True, name="supervisor")

    def start(self) -> None:
        self._start_once()
        self._thread.start()

    def _start_once(self) -> bool:
        with self._lock:
            if self.process.running():
                return True
            try:
                self.process.start()
            except Exception:  # a start that failed is retried by the watcher, as the kubelet does
                self.failed_starts += 1
                return False
        if self._on_start is not None:
            self._on_start()
        return True

    def _watch(self) -> None:
        attempt = 0
        while not self._stop.is_set():
            proc = self.process.proc
            if self._held.is_set() or proc is None or proc.poll() is None:
                self._stop.wait(0.1)
                continue
            if proc is not self._recorded:
                self._recorded = proc
                self.exits.append(proc.returncode)
            self._stop.wait(BACKOFF_S[min(attempt, len(BACKOFF_S) - 1)])
            if self._stop.is_set() or self._held.is_set():
                continue
            started = time.monotonic()
            if self._start_once():
                self.restarts += 1
            attempt += 1
            while self.process.running() and not self._stop.is_set():
                if time.monotonic() - started > RESET_AFTER_S:
                    attempt = 0
                    break
                self._stop.wait(0.1)

    def hold(self) -> None:
        """No restarts until :meth:`release` (a planned stop, a config change)."""
        self._held.set()

    def release(self) -> None:
        self._held.clear()

    def wait_running(self, timeout: float = 120.0) -> None:
        """Block until the process is up (the watcher restarts it)."""
        deadline = time.monotonic() + timeout
        while not self.process.running():
            if time.monotonic() > deadline:
                raise RuntimeError(f"sidecar not restarted in {timeout} s: {self.process.log()}")
            if self._held.is_set():
                self._start_once()
            time.sleep(0.1)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
