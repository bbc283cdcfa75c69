"""Loopback TCP proxies that put a fault on the wire between the sidecar and a shared tier.

Why: the soak breaks the link, not the code: a partition, a reset, a stalled
or erroring endpoint and a corrupted reply are what a real network and a real
S3 do, and the sidecar must see them exactly as it would in a cluster, through
its own client libraries. One thread per connection (a soak has a handful).

Two proxies, one switch (:attr:`mode`, set by the schedule):

* :class:`TcpFaultProxy` forwards bytes (Valkey's RESP): ``partition`` holds
  every byte in both directions and new connections are accepted but not
  answered (packets dropped: the peer sees silence, then its own timeout);
  ``reset`` answers every connection, old and new, with a TCP RST.
* :class:`HttpFaultProxy` forwards HTTP/1.1 one request at a time (S3):
  additionally ``http503`` answers each request with ``503 SlowDown`` without
  asking upstream, ``stall`` holds each reply until the fault ends, and
  ``corrupt`` flips one byte in the body of each object GET (a ``200`` reply
  of at least :data:`CORRUPT_MIN_BYTES`: an object, not an XML listing).
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from collections.abc import Callable

from kvstrata.testing.servers import LOOPBACK, free_port

MODES = ("pass", "partition", "reset", "stall", "http503", "corrupt")
READ_BYTES = 1 << 16
CORRUPT_MIN_BYTES = 1024
HOLD_STEP_S = 0.05  # how often a held byte checks whether the fault ended
_RST = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends RST


def _reset(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RST)
    with contextlib.suppress(OSError):
        sock.close()


class TcpFaultProxy:
    """``127.0.0.1:port`` forwarded to ``127.0.0.1:upstream_port``."""

    modes: tuple[str, ...] = ("pass", "partition", "reset")

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = free_port()
        self._mode = "pass"
        self._changed = threading.Condition()
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._listener = socket.create_server((LOOPBACK, self.port))
        self._closed = False
        self.connections_total = 0
        threading.Thread(target=self._accept, daemon=True, name=f"proxy-{self.port}").start()

    @property
    def mode(self) -> str:
        return self._mode

    def set_mode(self, mode: str) -> None:
        if mode not in self.modes:
            raise ValueError(f"{type(self).__name__}: mode {mode!r} not one of {self.modes}")
        with self._changed:
            self._mode = mode
            self._changed.notify_all()
        if mode == "reset":
            with self._lock:
                victims = list(self._conns)
                self._conns.clear()
            for sock in victims:
                _reset(sock)

    def _hold(self) -> bool:
        """Wait while partitioned (or stalled); False once the proxy closed."""
        with self._changed:
            while self._mode in ("partition", "stall") and not self._closed:
                self._changed.wait(HOLD_STEP_S)
        return not self._closed

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            victims = list(self._conns)
            self._conns.clear()
        for sock in victims:
            _reset(sock)

    def _track(self, *socks: socket.socket) -> None:
        with self._lock:
            self._conns.update(socks)

    def _forget(self, *socks: socket.socket) -> None:
        with self._lock:
            self._conns.difference_update(socks)
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            self.connections_total += 1
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        if self._mode == "reset":
            _reset(client)
            return
        if not self._hold():  # partitioned: the handshake is done, nothing more
            _reset(client)
            return
        try:
            upstream = socket.create_connection((LOOPBACK, self.upstream_port), timeout=5)
        except OSError:
            _reset(client)
            return
        upstream.settimeout(None)
        self._track(client, upstream)
        self._relay(client, upstream)

    def _relay(self, client: socket.socket, upstream: socket.socket) -> None:
        def pump(src: socket.socket, dst: socket.socket) -> None:
            try:
                while True:
                    data = src.recv(READ_BYTES)
                    if not data or not self._hold():
                        break
                    dst.sendall(data)
            except OSError:
                pass
            self._forget(src, dst)

        threading.Thread(target=pump, args=(upstream, client), daemon=True).start()
        pump(client, upstream)


class _Reader:
    """Buffered reads of one socket: lines and exact byte counts."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""

    def _fill(self) -> None:
        data = self.sock.recv(READ_BYTES)
        if not data:
            raise ConnectionError("peer closed")
        self.buf += data

    def head(self) -> bytes:
        while b"\r\n\r\n" not in self.buf:
            self._fill()
        head, _, self.buf = self.buf.partition(b"\r\n\r\n")
        return head + b"\r\n\r\n"

    def exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._fill()
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def line(self) -> bytes:
        while b"\r\n" not in self.buf:
            self._fill()
        line, _, self.buf = self.buf.partition(b"\r\n")
        return line + b"\r\n"

    def body(self, head: bytes, has_body: bool = True) -> bytes:
        """The message body that follows ``head`` (Content-Length or chunked)."""
        if not has_body:
            return b""
        headers = _headers(head)
        if "chunked" in headers.get("transfer-encoding", ""):
            out = b""
            while True:
                size_line = self.line()
                out += size_line
                size = int(size_line.split(b";")[0].strip(), 16)
                out += self.exactly(size + 2)
                if size == 0:
                    return out
        return self.exactly(int(headers.get("content-length", "0")))


def _headers(head: bytes) -> dict[str, str]:
    lines = head.decode("latin-1").split("\r\n")[1:]
    out = {}
    for line in lines:
        name, sep, value = line.partition(":")
        if sep:
            out[name.strip().lower()] = value.strip()
    return out


SLOWDOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)


class HttpFaultProxy(TcpFaultProxy):
    """HTTP/1.1 request by request, so a fault can be one reply (module docstring)."""

    modes = MODES

    def __init__(self, upstream_port: int, on_corrupt: Callable[[], None] | None = None) -> None:
        self.corrupted_total = 0
        self.refused_total = 0
        self._on_corrupt = on_corrupt
        super().__init__(upstream_port)

    def _relay(self, client: socket.socket, upstream: socket.socket) -> None:
        down, up = _Reader(client), _Reader(upstream)
        try:
            while True:
                head = down.head()
                body = down.body(head)
                method = head.split(b" ", 1)[0].upper()
                if not self._hold():
                    break
                if self._mode == "http503":
                    self.refused_total += 1
                    client.sendall(
                        b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\n"
                        b"Content-Length: %d\r\n\r\n%s" % (len(SLOWDOWN), SLOWDOWN)
                    )
                    continue
                upstream.sendall(head + body)
                reply_head = up.head()
                status = int(reply_head.split(b" ", 2)[1])
                has_body = method != b"HEAD" and status not in (204, 304)
                reply = up.body(reply_head, has_body)
                if not self._hold():  # stall: the reply waits for the fault to end
                    break
                if (
                    self._mode == "corrupt"
                    and method == b"GET"
                    and status == 200
                    and len(reply) >= CORRUPT_MIN_BYTES
                ):
                    middle = len(reply) // 2
                    reply = reply[:middle] + bytes([reply[middle] ^ 0xFF]) + reply[middle + 1 :]
                    self.corrupted_total += 1
                    if self._on_corrupt is not None:
                        self._on_corrupt()
                client.sendall(reply_head + reply)
        except (OSError, ValueError, IndexError):
            pass
        self._forget(client, upstream)
