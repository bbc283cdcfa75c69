"""The connector's CUDA copy ordering (connector.device.CudaCopies) without a GPU.

``torch.cuda``'s streams and events are replaced by
:class:`~kvstrata.testing.streams.RecordingStreams`, a double that records,
in order, which stream waits for which event and where each event is
recorded, so the ordering CudaCopies promises is checked step by step.
What only a GPU shows is in tests/gpu.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvstrata.connector import device as device_module
from kvstrata.connector.connector import KVStrataConnector
from kvstrata.testing.streams import RecordingStreams, unordered_launches


@pytest.fixture
def streams(monkeypatch: pytest.MonkeyPatch) -> RecordingStreams:
    double = RecordingStreams()
    monkeypatch.setattr(device_module.torch, "cuda", double.as_torch_cuda())
    return double


def test_a_load_is_ordered_before_anything_vllm_queues_after_it(
    streams: RecordingStreams,
) -> None:
    copies = device_module.CudaCopies(torch.device("cuda", 0))
    streams.launch("previous step")
    with copies.loading():
        pass  # the copies
    streams.launch("this step's forward")
    # The copy stream waited for vLLM's queued work, and vLLM's stream for the copies.
    assert streams.log[1] == ("wait_stream", "copy", "compute")
    assert streams.log[-3:] == [
        ("record", "event0", "copy"),
        ("wait_event", "compute", "event0"),
        ("launch", "compute", "this step's forward"),
    ]
    assert unordered_launches(streams.log) == []


def test_a_copy_failing_part_way_still_orders_vllm_after_what_was_queued(
    streams: RecordingStreams,
) -> None:
    copies = device_module.CudaCopies(torch.device("cuda", 0))
    with pytest.raises(RuntimeError), copies.loading():
        raise RuntimeError("a copy of layer 1 failed")
    streams.launch("recompute of the blocks not loaded")
    assert unordered_launches(streams.log) == []
    streams.log.clear()
    copies.loads_done()
    # The lease release waits for the same copies.
    assert streams.log == [("event_synchronize", "event0", "")]


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
    copies = device_module.CudaCopies(torch.device("cuda", 1))
    arena = torch.zeros(4096, dtype=torch.uint8)
    copies.register_arena(arena)  # inside a step: must not wait for the registration
    assert cudart.entered.wait(10)
    assert not cudart.finished  # returned while the registration still runs
    assert devices_set == [torch.device("cuda", 1)]  # on this rank's GPU, not device 0
    cudart.release.set()
    copies.unregister_arena()
    assert cudart.calls == ["register", "unregister"]


def test_unregistering_the_arena_waits_for_our_copies_only_not_the_whole_device(
    streams: RecordingStreams, monkeypatch: pytest.MonkeyPatch
) -> None:
    cudart = BlockingCudart()
    cudart.release.set()
    device_waits: list[Any] = []
    cuda = device_module.torch.cuda
    monkeypatch.setattr(cuda, "cudart", lambda: cudart, raising=False)
    monkeypatch.setattr(cuda, "set_device", lambda device: None, raising=False)
    monkeypatch.setattr(cuda, "synchronize", device_waits.append, raising=False)
    copies = device_module.CudaCopies(torch.device("cuda", 0))
    copies.register_arena(torch.zeros(4096, dtype=torch.uint8))
    streams.log.clear()
    copies.unregister_arena()  # a sidecar restart re-maps the arena inside a step
    assert cudart.calls == ["register", "unregister"]
    assert streams.log == [("synchronize", "copy", "")]  # the copy stream, before unregister
    assert device_waits == []  # vLLM's queued compute is not waited for
