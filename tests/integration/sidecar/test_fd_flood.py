"""A connection flood cannot take the sidecar's file descriptors from ZeroMQ.

A real sidecar runs under a low descriptor limit (``prlimit``, soft and hard
256, so the flood is small); the test holds idle connections to its HTTP
port and its liveness socket, past the caps, over loopback and a Unix
socket, and closes them at the end. Then a real client's ZeroMQ connection
is served, probes answer, and no accept failed (a failed accept is what
made the listener spin, and what aborts libzmq)."""

from __future__ import annotations

import os
import shutil
import socket
import urllib.request
from pathlib import Path
from typing import Any

import pytest

NOFILE = 256
EXTRA = 40  # connections past each cap
NBYTES = 4096

pytestmark = pytest.mark.skipif(shutil.which("prlimit") is None, reason="needs util-linux prlimit")


def _metrics(sidecar: Any) -> dict[str, float]:
    """``name{labels}`` -> value of the kvstrata_connections/accept series."""
    out = {}
    for line in sidecar.get("/metrics").splitlines():
        if line.startswith(("kvstrata_connections_", "kvstrata_accept_errors_total")):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _accounted(sidecar: Any, kit: Any, listener: str, flood: int) -> bool:
    """Every flood connection of ``listener`` was accepted and is open or was closed."""
    try:
        return kit.connections_taken_in(sidecar, listener) >= flood
    except OSError:
        return False


def _connect_unix(path: str, kit: Any, patience_s: float) -> socket.socket:
    """A connection to ``path``, retried while the listen backlog is full.

    A socket with a timeout is non-blocking underneath, and Linux answers a
    non-blocking Unix connect with EAGAIN at once while the listen backlog is
    full (``unix_stream_connect`` in net/unix/af_unix.c): the listener thread
    has not got to the queue yet, which on a loaded machine is no failure of
    the sidecar's (4edd4cb stopped accepting at its limit: there the wait
    times out)."""

    def attempt() -> socket.socket | None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(2)
        try:
            sock.connect(path)
        except BlockingIOError:
            sock.close()
            return None
        return sock

    return kit.wait_until(attempt, patience_s, f"room in the listen backlog of {path}", step=0.01)


def _probe(sidecar: Any, path: str) -> int:
    with urllib.request.urlopen(sidecar.url(path), timeout=10) as resp:
        return int(resp.status)


def test_idle_connections_past_the_caps_leave_zeromq_probes_and_the_cpu_alone(
    tmp_path: Path, kit: Any
):
    class LimitedSidecar(kit.Sidecar):
        def command(self) -> list[str]:
            return ["prlimit", f"--nofile={NOFILE}:{NOFILE}", "--", *kit.SIDECAR_COMMAND]

    sidecar = LimitedSidecar(tmp_path / "sc").start()
    flood: list[socket.socket] = []
    try:
        m = _metrics(sidecar)
        # (4edd4cb had no caps to read: its fixed 1,024 and, for liveness, any number)
        http_cap = int(m.get('kvstrata_connections_limit{listener="http"}', 1024))
        live_cap = int(m.get('kvstrata_connections_limit{listener="liveness"}', 64))
        print(f"caps: http {http_cap}, liveness {live_cap}")
        assert http_cap > 0 and live_cap > 0
        assert sidecar.proc is not None
        pid = sidecar.proc.pid
        for _ in range(http_cap + EXTRA):
            flood.append(socket.create_connection(("127.0.0.1", sidecar.http_port), timeout=5))
        live_path = sidecar.endpoint[len("ipc://") :] + ".live"
        for _ in range(live_cap + EXTRA):
            flood.append(_connect_unix(live_path, kit, patience_s=30))
        # The sidecar took the whole flood in (or, on 4edd4cb, ran out of descriptors).
        try:
            kit.wait_until(
                lambda: (
                    _fds(pid) >= NOFILE - 4
                    or (
                        _accounted(sidecar, kit, "http", http_cap + EXTRA)
                        and _accounted(sidecar, kit, "liveness", live_cap + EXTRA)
                    )
                ),
                timeout=60,
                what="the sidecar accepting the flood",
            )
        except AssertionError as exc:
            raise AssertionError(
                f"{exc}: the sidecar has {_fds(pid)} descriptors, its counters: {_metrics(sidecar)}"
            ) from None

        # A real client connects over ZeroMQ (and its own liveness socket) and is served.
        client = sidecar.client(call_timeout_s=10.0)
        keys = kit.make_keys(4, seed=2611)
        assert kit.store(client, keys, NBYTES, owner="w") == 4
        assert kit.retrieve(client, keys, owner="r") == [kit.payload(k, NBYTES) for k in keys]
        assert sidecar.running(), sidecar.log()  # on 4edd4cb: SIGABRT from libzmq

        # Probes answer every time while the flood is still held.
        assert [_probe(sidecar, "/healthz") for _ in range(10)] == [200] * 10
        assert [_probe(sidecar, "/readyz") for _ in range(10)] == [200] * 10

        m = _metrics(sidecar)
        # The caps kept the sidecar below its limit: no accept ever failed, so no
        # listener spun on one that stays readable.
        assert m['kvstrata_accept_errors_total{listener="http"}'] == 0
        assert m['kvstrata_accept_errors_total{listener="liveness"}'] == 0
        assert m['kvstrata_connections_open{listener="http"}'] <= http_cap
        assert m['kvstrata_connections_open{listener="liveness"}'] <= live_cap
        assert _fds(pid) < NOFILE
        made_room = m['kvstrata_connections_closed_total{listener="liveness",reason="made_room"}']
        assert made_room >= EXTRA  # idle ones gave way, the client's was let in
        assert client.ping()
        client.close()
    finally:
        for sock in flood:
            sock.close()
        sidecar.cleanup()
