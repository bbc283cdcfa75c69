"""The sidecar's log lines: text for people, JSON for log pipelines, request ids in both.

Why a context variable: a request is answered on the server's loop or on a
pool thread, and what logs on its behalf (handlers, engine, tiers) knows
nothing of the request. :func:`request_context` sets the request's id, op and
client for the duration of its answer; a filter copies them onto every record
logged meanwhile, so ``grep req=42`` (or a JSON query on ``request_id``) finds
everything one request caused. Lines are per event, never per hit: the
request path logs only what is unusual (refusals at DEBUG, failures).

Formats (``log_format`` in the config):

* ``text``: ``2026-11-23 10:00:00,000 WARNING kvstrata.sidecar.server: ...
  [req=42 op=LOOKUP client=vllm-worker-0]``
* ``json``: one object per line: ``ts`` (RFC 3339, UTC), ``level``,
  ``logger``, ``msg``, and ``request_id``/``op``/``client_id`` inside a
  request, ``exc`` with the traceback where there is one.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

LogFormat = Literal["text", "json"]

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s%(request_suffix)s"


@dataclass(frozen=True, slots=True)
class RequestInfo:
    request_id: int
    op: str
    client_id: str


_current: contextvars.ContextVar[RequestInfo | None] = contextvars.ContextVar(
    "kvstrata_request", default=None
)


@contextlib.contextmanager
def request_context(request_id: int, op: str, client_id: str) -> Iterator[None]:
    """Records logged inside carry this request's id, op and client."""
    token = _current.set(RequestInfo(request_id, op, client_id))
    try:
        yield
    finally:
        _current.reset(token)


class RequestFilter(logging.Filter):
    """Copies the current request (if any) onto each record; never drops one."""

    def filter(self, record: logging.LogRecord) -> bool:
        info = _current.get()
        record.request = info
        record.request_suffix = (
            "" if info is None else f" [req={info.request_id} op={info.op} client={info.client_id}]"
        )
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per record (see the module docstring for the keys)."""

    def format(self, record: logging.LogRecord) -> str:
        ts = datetime.datetime.fromtimestamp(record.created, tz=datetime.timezone.utc)
        out: dict[str, object] = {
            "ts": ts.isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        info = getattr(record, "request", None)
        if isinstance(info, RequestInfo):
            out.update(request_id=info.request_id, op=info.op, client_id=info.client_id)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def configure_logging(level: str, fmt: LogFormat) -> None:
    """Route the process's logging to stderr in ``fmt`` at ``level`` (replaces handlers)."""
    handler = logging.StreamHandler()
    handler.addFilter(RequestFilter())
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
