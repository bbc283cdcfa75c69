"""The connector's CUDA copy ordering (connector.device.CudaCopies) without a GPU,
and the graph-mode answer it rests on, read through vLLM's own config resolution.

``torch.cuda``'s streams and events are replaced by :class:`RecordingStreams`,
a double that records, in order, which stream waits for which event and
where each event is recorded, so the ordering CudaCopies promises is checked
step by step. What only a GPU shows is in tests/gpu.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvstrata.connector import device as device_module
from kvstrata.connector.connector import KVStrataConnector, hooks_skipped


class RecordingStreams:
    """A double of torch.cuda's streams and events (see the module docstring)."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str, str]] = []
        self.compute = self.Stream(self, "compute")
        self._events = 0

    def Stream(self, owner: RecordingStreams | None = None, name: str = "", **_: Any) -> Any:
        log = self

        class _Stream:
            def __init__(self) -> None:
                self.name = name or "copy"

            def wait_stream(self, other: Any) -> None:
                log.log.append(("wait_stream", self.name, other.name))

            def wait_event(self, event: Any) -> None:
                log.log.append(("wait_event", self.name, event.name))

            def synchronize(self) -> None:
                log.log.append(("synchronize", self.name, ""))

        return _Stream()

    def Event(self, **_: Any) -> Any:
        log = self
        log._events += 1

        class _Event:
            name = f"event{log._events - 1}"

            def record(self, stream: Any = None) -> None:
                log.log.append(("record", self.name, stream.name))

            def synchronize(self) -> None:
                log.log.append(("event_synchronize", self.name, ""))

        return _Event()

    def current_stream(self, device: Any = None) -> Any:
        return self.compute

    @contextmanager
    def stream(self, stream: Any) -> Iterator[None]:
        yield


@pytest.fixture
def streams(monkeypatch: pytest.MonkeyPatch) -> RecordingStreams:
    double = RecordingStreams()
    cuda = SimpleNamespace(
        Stream=double.Stream,
        Event=double.Event,
        current_stream=double.current_stream,
        stream=double.stream,
    )
    monkeypatch.setattr(device_module.torch, "cuda", cuda)
    return double


def test_a_step_replayed_as_a_full_graph_waits_for_the_whole_load_before_compute(
    streams: RecordingStreams,
) -> None:
    copies = device_module.CudaCopies(torch.device("cuda", 0), 3)
    with copies.loading():
        for layer in range(3):
            copies.layer_loaded(layer)
    streams.log.clear()
    copies.wait_for_all_loads()
    # vLLM's stream waits for the last layer's event, recorded after every copy.
    assert streams.log == [("wait_event", "compute", "event2")]


def test_a_copy_failing_part_way_still_leaves_every_wait_covering_what_was_queued(
    streams: RecordingStreams,
) -> None:
    copies = device_module.CudaCopies(torch.device("cuda", 0), 3)
    with pytest.raises(RuntimeError), copies.loading():
        copies.layer_loaded(0)
        raise RuntimeError("a copy of layer 1 failed")
    # Layers 1 and 2 get their events recorded after what was queued ...
    assert ("record", "event1", "copy") in streams.log
    assert ("record", "event2", "copy") in streams.log
    streams.log.clear()
    copies.wait_for_layer(2)
    copies.loads_done()
    # ... so vLLM's layer wait and the lease release both wait for them.
    assert streams.log == [
        ("wait_event", "compute", "event2"),
        ("event_synchronize", "event2", ""),
    ]


@pytest.mark.parametrize(
    ("mode", "skipped"),
    [("NONE", False), ("PIECEWISE", False), ("FULL", True)],
)
def test_only_a_full_graph_replay_counts_as_skipping_the_layer_hooks(
    mode: str, skipped: bool
) -> None:
    from vllm.config import CUDAGraphMode

    context = SimpleNamespace(cudagraph_runtime_mode=CUDAGraphMode[mode])
    assert hooks_skipped(context) is skipped
    assert hooks_skipped(None) is True  # a context that does not say: the safe side


def test_vllm_keeps_full_cuda_graphs_with_the_connector() -> None:
    # VllmConfig.__post_init__ (vllm/config/vllm.py) asks the connector class
    # vLLM's factory resolves from the transfer config whether to force
    # PIECEWISE; on this CPU platform it never gets there (no CUDA graphs), so
    # the same two calls are made here.
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    transfer = KVTransferConfig(
        kv_connector="KVStrataConnector",
        kv_connector_module_path="kvstrata.connector",
        kv_role="kv_both",
        kv_connector_extra_config={"endpoint": "ipc:///tmp/kvstrata.sock"},
    )
    connector_cls = KVConnectorFactory.get_connector_class(transfer)
    assert connector_cls is KVStrataConnector
    assert (
        connector_cls.requires_piecewise_for_cudagraph(transfer.kv_connector_extra_config) is False
    )


class BlockingCudart:
    """A double of torch.cuda.cudart(): cudaHostRegister blocks until released,
    as page-locking tens of GiB takes seconds."""

    def __init__(self) -> None:
        import threading

        self.entered, self.release = threading.Event(), threading.Event()
        self.calls: list[str] = []
        self.finished = False

    def cudaHostRegister(self, address: int, nbytes: int, flags: int) -> int:
        self.calls.append("register")
        self.entered.set()
        self.release.wait(30)
        self.finished = True
        return 0

    def cudaHostUnregister(self, address: int) -> int:
        self.calls.append("unregister")
        return 0


def test_the_arena_is_page_locked_off_the_step_and_unregistered_only_after(
    streams: RecordingStreams, monkeypatch: pytest.MonkeyPatch
) -> None:
    cudart = BlockingCudart()
    devices_set: list[Any] = []
    cuda = device_module.torch.cuda
    monkeypatch.setattr(cuda, "cudart", lambda: cudart, raising=False)
    monkeypatch.setattr(cuda, "set_device", devices_set.append, raising=False)
    monkeypatch.setattr(cuda, "synchronize", lambda device=None: None, raising=False)
    copies = device_module.CudaCopies(torch.device("cuda", 1), 2)
    arena = torch.zeros(4096, dtype=torch.uint8)
    copies.register_arena(arena)  # inside a step: must not wait for the registration
    assert cudart.entered.wait(10)
    assert not cudart.finished  # returned while the registration still runs
    assert devices_set == [torch.device("cuda", 1)]  # on this rank's GPU, not device 0
    cudart.release.set()
    copies.unregister_arena()
    assert cudart.calls == ["register", "unregister"]
