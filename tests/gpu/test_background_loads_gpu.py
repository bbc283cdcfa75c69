"""Background loads (``load_kv_async``) into KV on a GPU, host transfer mode:
the worker's loader thread copies on a CUDA stream of its own, after what
vLLM's stream had queued, and reports a request only once its copies are
done. Skipped where torch sees no CUDA device."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from kvstrata.connector.metadata import KVStrataMetadata
from kvstrata.testing.localstack import LocalSidecar
from kvstrata.testing.workers import chunk_requests, host_worker

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[LocalSidecar]:
    proc = LocalSidecar(tmp_path, chunk_size=16, l1_size="64Mi", l2_size="256Mi")
    proc.start()
    try:
        yield proc
    finally:
        proc.stop()


def test_background_loads_on_cuda_fill_the_bytes_that_were_saved(sidecar: LocalSidecar) -> None:
    # The plan from the strides (kv_cache_layout None): the view-order check against
    # vLLM's own KVCacheLayout is the CPU suite's; the lent GPU machines have no vLLM.
    w = host_worker(sidecar, model="gpu-background", device="cuda", kv_cache_layout=None)
    try:
        layout = w.layout
        assert layout is not None and layout.device.type == "cuda"
        reqs = chunk_requests("gpu-background", 3, 2)
        w.save(KVStrataMetadata(saves=reqs))
        assert w.counters.saved_chunks == 6, w.client.errors
        blocks = torch.tensor([b for r in reqs for c in r.chunks for b in c.block_ids])
        saved = [kv.index_select(layout.block_dim, blocks.to(kv.device)) for kv in layout.layers]
        for kv in layout.layers:
            kv.fill_(-1)  # vLLM's stream writes over them before the load starts
        w.start_load(KVStrataMetadata(loads=[replace(r, asynchronous=True) for r in reqs]))
        finished: set[str] = set()
        deadline = time.monotonic() + 20
        while len(finished) < len(reqs):
            assert time.monotonic() < deadline, f"reported: {finished}"
            finished |= w.take_finished().req_ids
            time.sleep(0.01)
        assert w.take_load_errors() == set()
        # Reported means copied: nothing further to wait for on any stream.
        # Bytes, not values: random KV bytes hold NaNs, which equal nothing.
        for kv, before in zip(layout.layers, saved, strict=True):
            after = kv.index_select(layout.block_dim, blocks.to(kv.device))
            assert torch.equal(after.view(torch.uint8), before.view(torch.uint8))
    finally:
        w.close()
