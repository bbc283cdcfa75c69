"""The GPU selftest's CPU-side logic: where its workers run and when a check
counts as having shown anything. The checks themselves need a GPU
(tests/gpu, ``kvstrata selftest gpu``)."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from kvstrata.testing import gpuipc, gpupeers, pidns, selftest
from kvstrata.testing.gpuipc import CheckFailed, EventWatch


def test_workers_share_the_pid_namespace_as_the_operators_pods_do(tmp_path: Path) -> None:
    assert pidns.worker_executable(pidns.POD, tmp_path) is None


def test_separate_namespaces_need_root_and_say_so(tmp_path: Path) -> None:
    with pytest.raises(CheckFailed, match="needs root"):
        pidns.worker_executable(pidns.SEPARATE, tmp_path, euid=1000, unshare="/usr/bin/unshare")
    with pytest.raises(CheckFailed, match="unshare"):
        pidns.worker_executable(pidns.SEPARATE, tmp_path, euid=0, unshare="")


def test_a_separate_namespace_worker_starts_python_under_unshare_pid(tmp_path: Path) -> None:
    script = pidns.worker_executable(
        pidns.SEPARATE, tmp_path, euid=0, unshare="/usr/bin/unshare", python="/opt/py/bin/python"
    )
    assert script is not None and os.access(script, os.X_OK)
    text = Path(script).read_text()
    assert 'exec /usr/bin/unshare --pid --fork --kill-child /opt/py/bin/python "$@"' in text


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="needs root and util-linux unshare (this machine lacks one)",
)
def test_a_worker_started_by_the_script_is_pid_1_of_its_own_namespace(tmp_path: Path) -> None:
    script = pidns.worker_executable(pidns.SEPARATE, tmp_path)
    assert script is not None
    out = subprocess.run(
        [script, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    if out.returncode != 0 and "Operation not permitted" in out.stderr:
        pytest.skip(f"this container forbids new PID namespaces: {out.stderr.strip()}")
    assert out.stdout.strip() == "1"


def test_an_unknown_mode_is_refused_naming_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(pidns.ENV, "shared-ish")
    with pytest.raises(CheckFailed, match=pidns.ENV):
        pidns.mode()


def test_the_command_line_option_reaches_the_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(pidns.ENV, raising=False)
    monkeypatch.setattr(selftest, "cannot_run_reason", lambda: "no CUDA device: test")
    args = argparse.Namespace(what="gpu", json=False, quick=True, no_bench=True)
    args.pid_namespace = "separate"
    assert selftest.run(args) == 2  # cannot run here, but the mode is set for the workers
    assert os.environ[pidns.ENV] == "separate"
    monkeypatch.delenv(pidns.ENV)


class NeverPending:
    """A double of the CUDA library whose events are always complete."""

    def ipc_event_done(self, device: int, handle: bytes) -> bool:
        return True


class PendingOnce:
    """A double whose event is pending at the first query."""

    def __init__(self) -> None:
        self.asked = 0

    def ipc_event_done(self, device: int, handle: bytes) -> bool:
        self.asked += 1
        return self.asked > 1


def test_an_event_check_that_never_saw_the_event_pending_fails_as_inconclusive() -> None:
    watch = EventWatch(NeverPending())
    assert watch.ipc_event_done(0, b"e" * 64)
    with pytest.raises(CheckFailed, match="inconclusive"):
        gpuipc.check_waited(watch)


def test_an_event_check_that_saw_the_event_pending_counts() -> None:
    watch = EventWatch(PendingOnce())
    assert not watch.ipc_event_done(0, b"e" * 64)
    assert watch.waiting.is_set() and watch.pending == 1
    assert watch.ipc_event_done(0, b"e" * 64)
    gpuipc.check_waited(watch)  # does not raise


def test_the_killed_peer_check_is_one_of_the_selftests_checks() -> None:
    assert selftest.CHECKS["killed-peer"] is selftest.check_killed_peer
    assert gpupeers.CASE in [(layout, dtype) for layout, dtype in gpuipc.ROUND_TRIP_CASES]
