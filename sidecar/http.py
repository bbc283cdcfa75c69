"""The sidecar's HTTP endpoints, on one port (``server.http_port``).

Why stdlib: four small read-only endpoints do not justify a web framework
in the sidecar image. A ``ThreadingHTTPServer`` runs in a daemon thread so
a slow scraper never touches the ZeroMQ loop.

* ``GET /metrics``  Prometheus text format, from the server's own registry
* ``GET /healthz``  200 while the process runs (liveness)
* ``GET /readyz``   200 once the engine is up and the ZMQ socket is bound and
                    served, 503 before and while shutting down (readiness)
* ``GET /status``   JSON: version, endpoint, arena, tiers (usage, capacity,
                    objects, queues, errors), engine counters, clients
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

logger = logging.getLogger(__name__)


class HttpEndpoints:
    """Serve the endpoints above until :meth:`close`."""

    def __init__(
        self,
        host: str,
        port: int,
        registry: CollectorRegistry,
        ready: Callable[[], bool],
        status: Callable[[], dict[str, Any]],
    ) -> None:
        routes: dict[str, Callable[[], tuple[int, str, bytes]]] = {
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

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                route = routes.get(self.path.split("?", 1)[0])
                if route is None:
                    code, ctype, body = 404, "text/plain", b"not found\n"
                else:
                    try:
                        code, ctype, body = route()
                    except Exception:  # one broken endpoint must not kill the thread
                        logger.exception("GET %s failed", self.path)
                        code, ctype, body = 500, "text/plain", b"internal error\n"
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                logger.debug("http: " + format, *args)

        self._httpd = ThreadingHTTPServer((host, port), Handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        # A short poll interval keeps shutdown (SIGTERM) quick.
        self._thread = threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.1},
            name="kvstrata-http",
            daemon=True,
        )

    def start(self) -> None:
        self._thread.start()
        logger.info("HTTP endpoints on port %d", self.port)

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
