"""The one poller the harnesses, benchmarks and tests wait with.

Nothing here sleeps a fixed time to let something happen: every wait polls
a condition against a deadline and names what it waited for when it gives
up.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_until(
    condition: Callable[[], Any],
    timeout: float,
    what: str,
    step: float = 0.02,
    error: type[BaseException] = AssertionError,
    retry_on: tuple[type[BaseException], ...] = (),
) -> Any:
    """Poll ``condition`` until it returns something truthy and return that.

    An exception ``condition`` raises propagates, unless it is one of
    ``retry_on`` (a probe that fails is "not yet") and not an ``error``
    (which always means "gone for good"). At the deadline ``error(message)``
    is raised, the message naming ``what``.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = condition()
        except retry_on as exc:
            if isinstance(exc, error):
                raise
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise error(f"timed out after {timeout}s waiting for {what}")
        time.sleep(step)
