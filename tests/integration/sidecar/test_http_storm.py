"""The HTTP port holds a scrape storm: a burst of concurrent scrapes all
answer, idle connections cost no thread, and clients that give up leave
nothing in the log.

What the kernel and the process did is read back rather than timed: the
listener's backlog and accept queue (``ss``, from iproute2), the process's
threads and open descriptors (``/proc``)."""

from __future__ import annotations

import os
import shutil
import socket
import struct
import subprocess
import threading
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from kvstrata.testing.poll import wait_until

STORM = 200
IDLE = 300
ANSWER_WITHIN_S = 10.0


def _threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError(f"no thread count for pid {pid}")


def _listener(port: int) -> tuple[int, int]:
    """(accept queue now, backlog) of the TCP listener on ``port``: for a
    listening socket ``ss`` reports them as Recv-Q and Send-Q."""
    if shutil.which("ss") is None:
        pytest.fail("ss (iproute2) is needed: make system-deps installs it")
    out = subprocess.run(["ss", "-ltnH"], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        fields = line.split()
        if len(fields) >= 4 and fields[3].rsplit(":", 1)[-1] == str(port):
            return int(fields[1]), int(fields[2])
    raise AssertionError(f"no listener on port {port}:\n{out}")


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_two_hundred_concurrent_scrapes_of_metrics_and_status_all_answer(sidecar: Any):
    # A connect the kernel drops (a full backlog) is retried a second later
    # at the earliest: the burst must fit the listener's queue.
    _, backlog = _listener(sidecar.http_port)
    assert backlog >= STORM, backlog
    answered: list[str] = []
    failed: list[str] = []
    go = threading.Barrier(STORM)

    def scrape(path: str) -> None:
        go.wait()
        try:
            with urllib.request.urlopen(sidecar.url(path), timeout=ANSWER_WITHIN_S) as resp:
                resp.read()
            answered.append(path)
        except OSError as exc:
            failed.append(f"{path}: {exc}")

    threads = [
        threading.Thread(target=scrape, args=("/metrics" if i % 2 else "/status",))
        for i in range(STORM)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert failed == [], f"{len(failed)} of {STORM} scrapes failed, e.g. {failed[:3]}"
    assert len(answered) == STORM


def test_three_hundred_idle_connections_hold_no_threads_and_a_scrape_still_answers(
    sidecar: Any, kit: Any
):
    assert sidecar.proc is not None
    before = _threads(sidecar.proc.pid)
    idle = [socket.create_connection(("127.0.0.1", sidecar.http_port)) for _ in range(IDLE)]
    try:
        # The server has accepted them all: none waits in the accept queue and
        # each is open or was closed by the server. (Counted, not read off the
        # descriptors: on a loaded machine the first ones reach their idle
        # deadline before the last one is accepted.)
        wait_until(
            lambda: (
                _listener(sidecar.http_port)[0] == 0
                # not counting the scrape that asks
                and kit.connections_taken_in(sidecar, "http") - 1 >= IDLE
            ),
            30,
            "the server to accept the idle connections",
        )
        assert _threads(sidecar.proc.pid) < before + 20
        assert "kvstrata_" in sidecar.get("/metrics")
    finally:
        for sock in idle:
            sock.close()


def test_clients_that_give_up_leave_nothing_in_the_log(sidecar: Any):
    assert sidecar.proc is not None
    assert sidecar.get("/healthz").strip() == "ok"
    fds = _open_fds(sidecar.proc.pid)
    for _ in range(50):
        sock = socket.create_connection(("127.0.0.1", sidecar.http_port))
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        # Close with a reset, as a scraper that timed out does.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
    half = socket.create_connection(("127.0.0.1", sidecar.http_port))
    half.sendall(b"GET /status HTT")  # and one that stops halfway
    half.close()
    assert sidecar.get("/healthz").strip() == "ok"
    # The server is done with all of them (it closes a connection after
    # whatever it had to say about it): its descriptors are back.
    wait_until(
        lambda: _open_fds(sidecar.proc.pid) <= fds,
        30,
        "the server to close the given-up connections",
    )
    assert sidecar.get("/healthz").strip() == "ok"  # one more turn of its loop
    log = sidecar.log()
    for noise in ("Traceback", "BrokenPipeError", "ConnectionResetError", "Exception"):
        assert noise not in log, log
