"""Log records carry the request they were logged for; JSON lines parse."""

from __future__ import annotations

import io
import json
import logging
import threading

from kvstrata.sidecar.logs import TEXT_FORMAT, JsonFormatter, RequestFilter, request_context


def capture(formatter: logging.Formatter) -> tuple[logging.Logger, io.StringIO]:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.addFilter(RequestFilter())
    handler.setFormatter(formatter)
    log = logging.getLogger(f"kvstrata.test.logs.{id(out)}")
    log.propagate = False
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    return log, out


def test_json_lines_carry_the_request_inside_its_context_only():
    log, out = capture(JsonFormatter())
    log.info("before")
    with request_context(42, "LOOKUP", "vllm-0"):
        log.warning("inside %d", 7)
    log.info("after")
    before, inside, after = (json.loads(line) for line in out.getvalue().splitlines())
    assert "request_id" not in before and "request_id" not in after
    assert inside["msg"] == "inside 7" and inside["level"] == "WARNING"
    assert (inside["request_id"], inside["op"], inside["client_id"]) == (42, "LOOKUP", "vllm-0")
    assert inside["ts"].endswith("+00:00")


def test_a_traceback_goes_into_the_json_object_not_onto_extra_lines():
    log, out = capture(JsonFormatter())
    try:
        raise KeyError("boom")
    except KeyError:
        log.exception("failed")
    (line,) = out.getvalue().splitlines()
    record = json.loads(line)
    assert "KeyError: 'boom'" in record["exc"]


def test_text_lines_end_with_the_request_and_threads_keep_their_own():
    log, out = capture(logging.Formatter(TEXT_FORMAT))
    seen = threading.Event()

    def other_thread() -> None:
        log.info("elsewhere")  # no request here, although the main thread is in one
        seen.set()

    with request_context(9, "PREPARE_STORE", "w1"):
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
        log.info("here")
    assert seen.is_set()
    lines = out.getvalue().splitlines()
    assert lines[0].endswith(": elsewhere"), lines[0]
    assert lines[1].endswith("here [req=9 op=PREPARE_STORE client=w1]")
