"""The sidecar's HTTP endpoints, on one port (``server.http_port``).

Why stdlib asyncio and not a thread per connection: Prometheus, probes and
people with curl all hit this port, sometimes hundreds at once, and some
connect and never send. One event loop thread holds any number of idle
connections for the cost of a buffer each; a small thread pool computes
the answers, so a scrape storm never touches the ZeroMQ loop and never
grows the thread count. Limits:

* listen backlog :data:`LISTEN_BACKLOG`: a burst of connects is queued by
  the kernel, not dropped;
* at most ``max_connections`` open at once (the sidecar sizes it from the
  descriptors it has, see :mod:`.fdbudget`; :data:`MAX_CONNECTIONS` when
  embedded). At the cap a newcomer closes the oldest connection still
  waiting for its request head, so idle connections, however many, never
  keep a kubelet probe out; only when every connection is being answered is
  the newcomer refused;
* an ``accept`` that fails for want of descriptors pauses accepting and is
  counted (asyncio removes the listener and retries after
  ``asyncio.constants.ACCEPT_RETRY_DELAY``: ``_accept_connection`` in
  ``asyncio/selector_events.py``, Python 3.11);
* a request head must arrive within :data:`READ_TIMEOUT_S` and fit
  :data:`MAX_HEAD_BYTES`, a reply must be taken within
  :data:`WRITE_TIMEOUT_S`; otherwise the connection is closed;
* :data:`WORKERS` threads compute answers (``/metrics`` and ``/status``
  take the L1 index's lock briefly), the rest wait their turn.

A client that goes away (reset, timeout, half a request) is closed and
logged as nothing: it is no error of ours. One reply per connection
(``Connection: close``); scrapers reconnect, which the backlog absorbs.

* ``GET /metrics``  Prometheus text format, from the server's own registry
* ``GET /healthz``  200 while the process runs (liveness)
* ``GET /readyz``   200 once the engine is up and the ZMQ socket is bound and
                    served, 503 before and while shutting down (readiness)
* ``GET /status``   JSON: version, endpoint, arena, tiers (usage, capacity,
                    objects, queues, errors), engine counters, clients, and
                    ``gpu_fault``: the CUDA fault that retired ipc mode ("" if none)
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import socket
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from kvstrata.sidecar.fdbudget import ListenerCounts

logger = logging.getLogger(__name__)

LISTEN_BACKLOG = 1024
ACCEPT_BURST = 16
MAX_CONNECTIONS = 1024
MAX_HEAD_BYTES = 8192
READ_TIMEOUT_S = 5.0
WRITE_TIMEOUT_S = 10.0
WORKERS = 4

Route = Callable[[], tuple[int, str, bytes]]
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            500: "Internal Server Error", 503: "Service Unavailable"}  # fmt: skip


class HttpEndpoints:
    """Serve the endpoints above from :meth:`start` until :meth:`close`.

    The constructor binds the port (raising ``OSError`` when it is taken),
    so a caller can name the setting before anything is served.
    """

    def __init__(
        self,
        host: str,
        port: int,
        registry: CollectorRegistry,
        ready: Callable[[], bool],
        status: Callable[[], dict[str, Any]],
        max_connections: int = MAX_CONNECTIONS,
        counts: ListenerCounts | None = None,
    ) -> None:
        self._routes: dict[str, Route] = {
            "/metrics": lambda: (200, CONTENT_TYPE_LATEST, generate_latest(registry)),
            "/healthz": lambda: (200, "text/plain", b"ok\n"),
            "/readyz": lambda: (
                (200, "text/plain", b"ready\n") if ready() else (503, "text/plain", b"not ready\n")
            ),
            "/status": lambda: (
                200,
                "application/json",
                json.dumps(status(), default=str).encode(),
            ),
        }
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.create_server((host, port), family=family, backlog=LISTEN_BACKLOG)
        self.port: int = self._sock.getsockname()[1]
        self._pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="kvstrata-http")
        self._loop = asyncio.new_event_loop()
        self._loop.set_exception_handler(self._exception_handler)
        self._stop: asyncio.Event | None = None
        self._started = threading.Event()
        self.counts = counts if counts is not None else ListenerCounts(max_connections)
        self.counts.limit = max_connections
        self.counts.listen_fd = self._sock.fileno()
        # Connections still waiting for their request head, oldest first: the
        # ones closed to make room at the cap.
        self._waiting: OrderedDict[asyncio.StreamWriter, None] = OrderedDict()
        self._thread = threading.Thread(target=self._run, name="kvstrata-http", daemon=True)

    def start(self) -> None:
        self._thread.start()
        self._started.wait(10)
        logger.info("HTTP endpoints on port %d", self.port)

    def close(self) -> None:
        if self._thread.is_alive():
            stop = self._stop
            if stop is not None:
                self._loop.call_soon_threadsafe(stop.set)
            self._thread.join(10)
        else:
            self._sock.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- the loop -------------------------------------------------------------

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._serve())
        finally:
            self._loop.close()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        # asyncio accepts up to ``backlog`` connections per wake-up before any
        # is handed to us (``_accept_connection``): a few at a time, so that
        # each is judged before the next takes a descriptor; then the kernel's
        # queue is made long again (asyncio listens with the number it was given).
        server = await asyncio.start_server(
            self._connection, sock=self._sock, backlog=ACCEPT_BURST, limit=MAX_HEAD_BYTES
        )
        self._sock.listen(LISTEN_BACKLOG)
        self._started.set()
        await self._stop.wait()
        server.close()
        # Connections still open (idle ones included) end now, not at their timeout.
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        counts = self.counts
        if writer.transport.get_extra_info("socket").fileno() >= counts.fd_ceiling:
            # On a descriptor of the reserve: the process is nearly out, and
            # libzmq aborts when it runs out (.fdbudget).
            counts.refused += 1
            writer.transport.abort()
            return
        if counts.open >= counts.limit:
            if not self._waiting:
                counts.refused += 1
                writer.transport.abort()
                return
            oldest, _ = self._waiting.popitem(last=False)
            counts.made_room += 1
            oldest.transport.abort()  # its task ends on the reset and frees its place
        counts.open += 1
        self._waiting[writer] = None
        try:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_TIMEOUT_S)
            except asyncio.TimeoutError:
                counts.idle_closed += 1
                raise
            finally:
                self._waiting.pop(writer, None)
            code, ctype, body = await self._answer(head)
            writer.write(
                (
                    f"HTTP/1.1 {code} {_REASONS.get(code, '')}\r\n"
                    f"Content-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                    "Connection: close\r\n\r\n"
                ).encode("latin-1")
                + body
            )
            await asyncio.wait_for(writer.drain(), WRITE_TIMEOUT_S)
        except (
            asyncio.TimeoutError,
            asyncio.IncompleteReadError,
            asyncio.LimitOverrunError,
            ConnectionError,
            OSError,
        ):
            pass  # the client went away, stalled or sent garbage: nothing to report
        finally:
            counts.open -= 1
            writer.close()

    async def _answer(self, head: bytes) -> tuple[int, str, bytes]:
        parts = head.split(b"\r\n", 1)[0].split()
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
            return 400, "text/plain", b"bad request\n"
        if parts[0] != b"GET":
            return 405, "text/plain", b"only GET\n"
        path = parts[1].decode("latin-1").split("?", 1)[0]
        route = self._routes.get(path)
        if route is None:
            return 404, "text/plain", b"not found\n"
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, route)
        except Exception:  # one broken endpoint must not take the port down
            logger.exception("GET %s failed", path)
            return 500, "text/plain", b"internal error\n"

    def _exception_handler(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        """Connection errors of clients that went away are no news; an accept
        that failed for want of descriptors is counted (asyncio pauses accepting
        and logs it); anything else is logged."""
        exc = context.get("exception")
        if isinstance(exc, (ConnectionError, TimeoutError)):
            return
        if isinstance(exc, OSError) and exc.errno in _OUT_OF_DESCRIPTORS:
            self.counts.accept_errors += 1
        with contextlib.suppress(Exception):
            loop.default_exception_handler(context)


_OUT_OF_DESCRIPTORS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
