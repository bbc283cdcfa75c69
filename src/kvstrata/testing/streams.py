"""A recording double of ``torch.cuda``'s streams and events, for CPU machines.

Why: the connector's CUDA ordering (:mod:`kvstrata.connector.device`) is a
promise about which stream waits for which event, and in which order work
is queued; without a GPU that order can still be checked step by step.
:class:`RecordingStreams` stands in for ``torch.cuda`` (``Stream``,
``Event``, ``current_stream``, ``stream``) and appends one entry per call
to :attr:`RecordingStreams.log`, ``(what, subject, object)``:

* ``("wait_stream", stream, other)``, ``("wait_event", stream, event)``,
  ``("synchronize", stream, "")``;
* ``("record", event, stream)``, ``("event_synchronize", event, "")``;
* ``("enter", stream, "")`` / ``("exit", stream, "")`` around work queued
  under ``torch.cuda.stream(stream)``;
* ``("launch", stream, name)``: a test's stand-in for vLLM queuing compute
  (:meth:`RecordingStreams.launch`).

Copies on CPU tensors inside ``enter``/``exit`` run at once; what the log
shows is the order a GPU would be asked to keep. What only a GPU shows is
in tests/gpu.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

LogEntry = tuple[str, str, str]


class RecordingStreams:
    """See the module docstring; the current stream is ``compute`` (vLLM's)."""

    def __init__(self) -> None:
        self.log: list[LogEntry] = []
        self._events = 0
        self._streams = 0
        self.compute = self._make_stream("compute")

    def _make_stream(self, name: str) -> Any:
        log = self.log

        class _Stream:
            def __init__(self) -> None:
                self.name = name

            def wait_stream(self, other: Any) -> None:
                log.append(("wait_stream", self.name, other.name))

            def wait_event(self, event: Any) -> None:
                log.append(("wait_event", self.name, event.name))

            def synchronize(self) -> None:
                log.append(("synchronize", self.name, ""))

        return _Stream()

    def Stream(self, **_: Any) -> Any:
        self._streams += 1
        return self._make_stream("copy" if self._streams == 1 else f"copy{self._streams}")

    def Event(self, **_: Any) -> Any:
        log = self.log
        name = f"event{self._events}"
        self._events += 1

        class _Event:
            def __init__(self) -> None:
                self.name = name

            def record(self, stream: Any = None) -> None:
                log.append(("record", self.name, stream.name))

            def synchronize(self) -> None:
                log.append(("event_synchronize", self.name, ""))

        return _Event()

    def current_stream(self, device: Any = None) -> Any:
        return self.compute

    @contextmanager
    def stream(self, stream: Any) -> Iterator[None]:
        self.log.append(("enter", stream.name, ""))
        try:
            yield
        finally:
            self.log.append(("exit", stream.name, ""))

    def launch(self, name: str) -> None:
        """vLLM queues compute ``name`` on its current stream."""
        self.log.append(("launch", "compute", name))

    def as_torch_cuda(self) -> Any:
        """The object to put in place of ``torch.cuda``."""
        return SimpleNamespace(
            Stream=self.Stream,
            Event=self.Event,
            current_stream=self.current_stream,
            stream=self.stream,
        )


def unordered_launches(log: list[LogEntry], copy_stream: str = "copy") -> list[str]:
    """Compute launches that could run before the copies queued on
    ``copy_stream`` ahead of them finished: a launch is ordered when, after
    the last copy work queued before it, an event was recorded on the copy
    stream and vLLM's stream waited for that event, both before the launch."""
    bad: list[str] = []
    for i, (what, _, name) in enumerate(log):
        if what != "launch":
            continue
        exits = [j for j in range(i) if log[j] == ("exit", copy_stream, "")]
        if not exits:
            continue  # nothing was copied before it
        last_copy = exits[-1]
        recorded = {
            log[j][1]
            for j in range(last_copy, i)
            if log[j][0] == "record" and log[j][2] == copy_stream
        }
        waited = any(
            log[j][0] == "wait_event" and log[j][1] == "compute" and log[j][2] in recorded
            for j in range(last_copy, i)
        )
        if not waited:
            bad.append(name)
    return bad
