"""A connection flood on every listener at once cannot abort the sidecar.

A real sidecar runs under ``prlimit --nofile=1024:1024`` (the soft limit
cannot be raised past it). Three real processes flood its ZeroMQ endpoint
(1,100 connections, more than the limit), its HTTP port and its liveness
socket at the same time, and hold what they got. libzmq aborts the process
when an accept on an ``ipc://`` endpoint finds no descriptor, so the sidecar
must stop accepting ZeroMQ connections first (:mod:`kvstrata.sidecar.zmqgate`).
A well-behaved client connected before the flood is served while it is
held; once the floods close their connections a new client connects and is
served; SIGTERM then ends the sidecar with exit code 0. The second test
lowers the limit of a running sidecar before it floods it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from kvstrata.testing.floods import Flood

NOFILE = 1024
NBYTES = 4096

pytestmark = pytest.mark.skipif(shutil.which("prlimit") is None, reason="needs util-linux prlimit")


def _metric(sidecar: Any, name: str, listener: str) -> float:
    prefix = f'{name}{{listener="{listener}"}} '
    for line in sidecar.get("/metrics").splitlines():
        if line.startswith(prefix):
            return float(line[len(prefix) :])
    raise AssertionError(f"/metrics has no {prefix.strip()}")


def _metric_or_none(sidecar: Any, name: str, listener: str) -> float | None:
    """The series, or None while a scrape is refused (the HTTP port keeps no
    connection on a descriptor of the reserve)."""
    try:
        return _metric(sidecar, name, listener)
    except OSError:
        return None


def _probe(sidecar: Any, path: str) -> int:
    with urllib.request.urlopen(sidecar.url(path), timeout=10) as resp:
        return int(resp.status)


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _flood_every_listener(
    sidecar: Any, kit: Any, zmq_count: int, other_count: int, nofile: int
) -> None:
    """Flood the three listeners together; check the sidecar while the floods
    hold their connections, then end them and check it again."""
    assert sidecar.proc is not None
    pid = sidecar.proc.pid
    path = sidecar.endpoint[len("ipc://") :]
    client = sidecar.client(call_timeout_s=10.0)
    keys = kit.make_keys(8, seed=3801)
    assert kit.store(client, keys[:4], NBYTES, owner="before") == 4

    floods = [
        Flood("unix", path, zmq_count),
        Flood("unix", path + ".live", other_count),
        Flood("tcp", f"127.0.0.1:{sidecar.http_port}", other_count),
    ]
    try:
        reports = [flood.report() for flood in floods]
        print(f"floods (held, refused): {[(r.held, r.refused) for r in reports]}")
        assert sidecar.running(), sidecar.log()  # before the gate: SIGABRT from libzmq
        # The endpoint stopped accepting before the descriptors ran out: part
        # of the flood found no socket file.
        assert reports[0].refused > 0
        held = _fds(pid)
        print(f"sidecar descriptors {held} of {nofile}")
        assert held < nofile
        # The client connected before the flood is served while it is held.
        assert kit.store(client, keys[4:], NBYTES, owner="during") == 4
        assert kit.retrieve(client, keys, owner="r") == [kit.payload(k, NBYTES) for k in keys]
    finally:
        codes = [flood.finish() for flood in floods]
    assert codes == [0, 0, 0]

    # The floods' connections close; the endpoint accepts again and a new
    # client is served. (While the floods held every descriptor the sidecar
    # let its listeners have, a new HTTP connection could be refused too.)
    kit.wait_until(
        lambda: (
            os.path.exists(path)
            and _metric_or_none(sidecar, "kvstrata_connections_open", "zmq") in (1.0, 2.0)
        ),
        timeout=60,
        what="the flood's ZeroMQ connections closed and the endpoint open again",
    )
    assert _metric(sidecar, "kvstrata_accept_pauses_total", "zmq") >= 1
    assert _probe(sidecar, "/readyz") == 200
    newcomer = sidecar.client(call_timeout_s=10.0)
    assert kit.retrieve(newcomer, keys, owner="after") == [kit.payload(k, NBYTES) for k in keys]
    newcomer.close()
    client.close()
    assert sidecar.running(), sidecar.log()
    assert sidecar.stop() == 0, sidecar.log()


def test_a_flood_of_every_listener_under_a_low_limit_leaves_the_sidecar_serving(
    tmp_path: Path, kit: Any
):
    class LimitedSidecar(kit.Sidecar):
        def command(self) -> list[str]:
            return ["prlimit", f"--nofile={NOFILE}:{NOFILE}", "--", *kit.SIDECAR_COMMAND]

    sidecar = LimitedSidecar(tmp_path / "sc").start()
    try:
        _flood_every_listener(sidecar, kit, zmq_count=1100, other_count=700, nofile=NOFILE)
    finally:
        sidecar.cleanup()


def test_a_limit_lowered_while_running_shrinks_the_caps_before_a_flood(tmp_path: Path, kit: Any):
    lowered = 512
    sidecar = kit.Sidecar(tmp_path / "sc").start()
    try:
        assert sidecar.proc is not None
        before = _metric(sidecar, "kvstrata_connections_limit", "zmq")
        subprocess.run(
            ["prlimit", "--pid", str(sidecar.proc.pid), f"--nofile={lowered}:{lowered}"],
            check=True,
        )
        kit.wait_until(
            lambda: _metric(sidecar, "kvstrata_connections_limit", "zmq") < before,
            timeout=30,
            what="the sidecar reading its lowered limit",
        )
        assert _metric(sidecar, "kvstrata_connections_limit", "zmq") < lowered
        _flood_every_listener(sidecar, kit, zmq_count=700, other_count=400, nofile=lowered)
    finally:
        sidecar.cleanup()
