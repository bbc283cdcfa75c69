"""A CUDA error while the worker orders a load after vLLM's queued work
costs a miss, never an exception in vLLM's step.

``compute_done_event`` (create an interprocess event, record it on vLLM's
stream, export its handle) runs inside ``start_load_kv``. On a GPU it
raises after a sticky CUDA fault or when no event can be created; a CPU
cannot cause that, so :class:`CudaEventFault` -- a fault double, named so
-- raises what torch raises then (a RuntimeError naming the CUDA error).
No sidecar is reached: the load ends before any call.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from kvstrata.connector import ipc
from kvstrata.connector.async_loads import AsyncLoads, LoadReports
from kvstrata.connector.client import SidecarClient
from kvstrata.connector.device import DeviceCopies
from kvstrata.connector.layout import detect_layout
from kvstrata.connector.metadata import ChunkKeys, ChunkTransfer, RequestTransfer
from kvstrata.connector.transfer_path import HostPath, IpcPath
from kvstrata.sidecar.keys import Namespace
from kvstrata.testing.kvlayouts import every_case


class CudaEventFault:
    """Fault double of ``ipc.compute_done_event`` (module docstring)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> Any:
        self.calls += 1
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


@pytest.fixture
def fault(monkeypatch: pytest.MonkeyPatch) -> CudaEventFault:
    double = CudaEventFault()
    monkeypatch.setattr(ipc, "compute_done_event", double)
    return double


@pytest.fixture
def client() -> Any:
    made = SidecarClient(
        "ipc:///nonexistent/kvstrata.sock", Namespace(model="m"), role="worker", call_timeout_s=0.2
    )
    yield made
    made.close()


def requests() -> list[RequestTransfer]:
    chunks = [ChunkTransfer(bytes([i]) * 32, [2 * i, 2 * i + 1]) for i in range(2)]
    return [RequestTransfer("r1", chunks[:1]), RequestTransfer("r2", chunks[1:])]


def test_an_ipc_load_whose_event_cannot_be_made_loads_nothing_and_raises_nothing(
    fault: CudaEventFault,
    client: SidecarClient,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(ipc.torch.cuda, "is_available", lambda: True)  # the worker's GPU
    with caplog.at_level(logging.ERROR):
        loaded = ipc.load_requests(client, ChunkKeys([b"f" * 8]).of, requests())
    assert fault.calls == 1
    assert loaded == [0, 0]  # the worker reports every chunk: vLLM recomputes
    assert any("cannot order the load" in r.getMessage() for r in caplog.records)


def test_a_background_load_whose_event_cannot_be_made_is_reported_failed_at_once(
    fault: CudaEventFault, client: SidecarClient
) -> None:
    case = every_case(torch.bfloat16)[0]
    layout = detect_layout(case.layers, kv_cache_layout=case.kv_cache_layout, blocks_per_chunk=2)
    host = HostPath(client, ChunkKeys([b"f" * 8]), (layout,), DeviceCopies())
    reports = LoadReports()
    loads = AsyncLoads(IpcPath(host, None), 1.0, reports)  # type: ignore[arg-type]
    try:
        # The KV stands for CUDA tensors: the sidecar would scatter into them.
        loads._device = torch.device("cuda", 0)
        loads.submit(requests())
        assert fault.calls == 1
        assert not loads.in_flight()
        done = reports.take()
        assert done.req_ids == {"r1", "r2"}
        assert done.failed_blocks == {0, 1, 2, 3} and done.loaded_chunks == 0
    finally:
        loads.close()
