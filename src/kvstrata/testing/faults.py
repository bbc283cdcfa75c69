"""Faults the real parts cannot produce by themselves, injected from outside.

:class:`FaultyLink`, a loopback TCP proxy in front of a real server (moto,
Valkey), for two network faults:

* a **stall**: connections are accepted and held open but no byte moves in
  either direction (a hung load balancer);
* a **slow link**: bytes from the server reach the client at a set rate (a
  congested path to a shared tier): small replies (``EXISTS``, ``HEAD``)
  still arrive at once, a chunk-sized reply takes its size over the rate;
* a **gate on large replies**: server-to-client reads of at least a set size
  (a chunk coming up, not an ``EXISTS`` answer) wait until the test
  releases them, so a test orders "the load is still held" against what
  else happens by its own steps rather than by the clock.

:func:`flip_last_byte`: a stored object damaged on disk behind its owner's
back (bit rot, a torn write), which the sidecar must catch by checksum.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import threading
import time
from typing import Any

from kvstrata.testing.servers import LOOPBACK

__all__ = ["FaultyLink", "SpawnedLink", "flip_last_byte"]

READ_BYTES = 1 << 16
SLICE_BYTES = 4096  # a throttled reply goes out in slices of this size


class FaultyLink:
    """Forwards ``127.0.0.1:port`` to ``upstream_port``; :meth:`stall`,
    :meth:`throttle` and :meth:`resume` change what it does to the bytes."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self._listener = socket.create_server((LOOPBACK, 0))
        self.port = int(self._listener.getsockname()[1])
        self._flowing = threading.Event()
        self._flowing.set()
        self._rate: float | None = None  # bytes per second server -> client; None: full speed
        self._hold_from: int | None = None  # server reads this large wait at the gate
        self._gate = threading.Event()
        self._gate.set()
        self.held_total = 0  # server reads that waited at the gate
        self._closed = threading.Event()
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    @property
    def endpoint_url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def url(self) -> str:
        """A ``redis://`` URL through the link (for a Valkey upstream)."""
        return f"redis://{LOOPBACK}:{self.port}/0"

    def stall(self) -> None:
        self._flowing.clear()

    def throttle(self, bytes_per_second: float) -> None:
        """From now on, server-to-client bytes flow at this rate."""
        if bytes_per_second <= 0:
            raise ValueError(f"bytes_per_second must be > 0, got {bytes_per_second}")
        self._rate = float(bytes_per_second)

    def hold_replies(self, from_bytes: int) -> None:
        """From now on, a server-to-client read of ``from_bytes`` or more
        waits until :meth:`release` (smaller replies still flow)."""
        self._gate.clear()
        self._hold_from = from_bytes

    def release(self) -> None:
        """Let held replies through and hold no more."""
        self._hold_from = None
        self._gate.set()

    def resume(self) -> None:
        """Full speed, no stall, no gate."""
        self._rate = None
        self._flowing.set()
        self.release()

    def close(self) -> None:
        self._closed.set()
        self._flowing.set()
        self._gate.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        self._listener.close()
        with self._lock:
            for sock in self._sockets:
                sock.close()
        for thread in self._threads:
            thread.join(timeout=2)

    def __enter__(self) -> FaultyLink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection((LOOPBACK, self.upstream_port), timeout=2)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._sockets += [client, upstream]
            thread = threading.Thread(target=self._pump, args=(client, upstream), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _pump(self, client: socket.socket, upstream: socket.socket) -> None:
        peers = {client: upstream, upstream: client}
        try:
            while not self._closed.is_set():
                if not self._flowing.is_set():
                    self._flowing.wait(0.05)
                    continue
                readable, _, _ = select.select(list(peers), [], [], 0.05)
                for sock in readable:
                    data = sock.recv(READ_BYTES)
                    if not data:
                        return
                    hold_from = self._hold_from
                    if sock is upstream and hold_from is not None and len(data) >= hold_from:
                        with self._lock:
                            self.held_total += 1
                        self._gate.wait()
                    if sock is upstream and self._rate is not None:
                        self._send_slowly(client, data, self._rate)
                    else:
                        peers[sock].sendall(data)
        except OSError:
            return
        finally:
            client.close()
            upstream.close()

    def _send_slowly(self, sock: socket.socket, data: bytes, rate: float) -> None:
        for start in range(0, len(data), SLICE_BYTES):
            piece = data[start : start + SLICE_BYTES]
            time.sleep(len(piece) / rate)
            sock.sendall(piece)


def flip_last_byte(path: str | os.PathLike[str]) -> None:
    """Invert the last byte of a file (its payload's, for a stored object)."""
    with open(path, "r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 0xFF]))


class SpawnedLink:
    """A :class:`FaultyLink` in a child process, throttled from the start.

    For timings: a link pumped by threads of a process that also runs a busy
    vLLM engine waits for that process's GIL between slices, and so is slower
    exactly while vLLM is busy (which would flatter inline loads, during which
    the engine sleeps in a socket call). A child process moves bytes on its own.
    """

    def __init__(self, upstream_port: int, bytes_per_second: float | None = None) -> None:
        import multiprocessing

        context = multiprocessing.get_context("spawn")  # no fork of a process with threads
        parent, child = context.Pipe()
        self._process = context.Process(
            target=_serve_link, args=(upstream_port, bytes_per_second, child), daemon=True
        )
        self._process.start()
        if not parent.poll(30):
            self._process.kill()
            raise RuntimeError("the link process did not start in 30 s")
        self.port = int(parent.recv())
        self._pipe = parent

    @property
    def url(self) -> str:
        return f"redis://{LOOPBACK}:{self.port}/0"

    @property
    def endpoint_url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._pipe.send("close")
        self._process.join(timeout=5)
        if self._process.is_alive():
            self._process.kill()

    def __enter__(self) -> SpawnedLink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _serve_link(upstream_port: int, bytes_per_second: float | None, pipe: Any) -> None:
    with FaultyLink(upstream_port) as link:
        if bytes_per_second is not None:
            link.throttle(bytes_per_second)
        pipe.send(link.port)
        pipe.recv()  # until the parent says close (or goes away)
