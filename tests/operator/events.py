"""The Events the operator posts, recorded instead of sent, for the cluster-free suite.

The handlers post Events with ``kopf.event``, which outside a running
operator has no queue to post to. The suite's autouse fixture (conftest)
puts :data:`EVENTS` in its place; a test that checks Events names the list
they go to with :func:`record_events` (else they are dropped).
"""

from __future__ import annotations

from typing import Any


class EventRecorder:
    """Stands in for ``kopf.event``: appends each Event's keyword arguments to a list."""

    def __init__(self) -> None:
        self.into: list[dict[str, Any]] | None = None

    def __call__(self, objs: Any, **kwargs: Any) -> None:
        if self.into is not None:
            self.into.append(kwargs)


EVENTS = EventRecorder()


def record_events(into: list[dict[str, Any]] | None) -> None:
    """Send the Events posted from here on (this test) to ``into``; None drops them."""
    EVENTS.into = into
