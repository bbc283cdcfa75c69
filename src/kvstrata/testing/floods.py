"""Connection floods of a sidecar from real processes: bounded, and ended by the test.

Why: a hostile or broken local process can open connections to every
listener of a sidecar (its ZeroMQ endpoint, its liveness socket, its HTTP
port) until the sidecar runs out of descriptors. A test needs such floods
from other processes (its own descriptors must not be the ones that run
out), of a known size, held while it checks the sidecar, and closed on its
word. Each :class:`Flood` is one process that opens ``count`` plain stream
connections to one target, reports how many it holds and how many were
refused (a missing socket file, a full backlog, a refused or reset
connection), holds them until :meth:`Flood.finish`, closes them and exits.

Run as ``python -m kvstrata.testing.floods unix|tcp TARGET COUNT``; TARGET
is a socket path or ``HOST:PORT``. It prints one JSON line
``{"held": N, "refused": M}`` and waits for its stdin to close.
"""

from __future__ import annotations

import json
import resource
import socket
import struct
import subprocess
import sys
from dataclasses import dataclass

__all__ = ["Flood", "FloodReport"]

CONNECT_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class FloodReport:
    held: int  # connections open when the flood reported
    refused: int  # connects that failed


class Flood:
    """One flooding process (module docstring); use as a context manager or
    call :meth:`finish`."""

    def __init__(self, kind: str, target: str, count: int) -> None:
        if kind not in ("unix", "tcp"):
            raise ValueError(f"kind {kind!r}: expected unix or tcp")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", __name__, kind, target, str(count)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def report(self) -> FloodReport:
        """Wait for the flood to have made every connect (its one line)."""
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the flood exited {self.proc.wait()} without a report")
        data = json.loads(line)
        return FloodReport(held=int(data["held"]), refused=int(data["refused"]))

    def finish(self, timeout: float = 60.0) -> int:
        """Tell the flood to close its connections; its exit code."""
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        return self.proc.wait(timeout=timeout)

    def __enter__(self) -> Flood:
        return self

    def __exit__(self, *_: object) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _connect(kind: str, target: str) -> socket.socket | None:
    if kind == "unix":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        address: str | tuple[str, int] = target
    else:
        host, _, port = target.rpartition(":")
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        address = (host, int(port))
    # Blocking, bounded by SO_SNDTIMEO: a non-blocking Unix connect fails at
    # once with EAGAIN while the listen backlog is full, and a flood must wait
    # for room as a client would (the kernel looks the name up again after
    # each wait: net/unix/af_unix.c, unix_stream_connect).
    timeout = struct.pack("ll", int(CONNECT_TIMEOUT_S), 0)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeout)
    try:
        sock.connect(address)
    except OSError:  # no socket file, backlog full, refused, reset, timed out
        sock.close()
        return None
    return sock


def main(argv: list[str]) -> int:
    kind, target, count = argv[0], argv[1], int(argv[2])
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    held: list[socket.socket] = []
    refused = 0
    for _ in range(count):
        sock = _connect(kind, target)
        if sock is None:
            refused += 1
        else:
            held.append(sock)
    print(json.dumps({"held": len(held), "refused": refused}), flush=True)
    sys.stdin.read()  # hold until the test closes our stdin
    for sock in held:
        sock.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
