"""Host mode's torch copier on a real GPU: one strided copy per run over every
layer, the chunk moved to or from pinned host memory in one DMA, the same
bytes as one copy per layer and run. Skipped where torch sees no CUDA device.
"""

from __future__ import annotations

import pytest
import torch

from kvstrata.connector.layout import detect_layout
from kvstrata.testing.kvlayouts import vllm_layers

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]


@pytest.mark.parametrize("layout_name", ["LBNHC", "BLNHC"])
def test_a_chunk_through_pinned_memory_holds_the_bytes_of_one_copy_per_layer(
    layout_name: str,
) -> None:
    case = vllm_layers(layout_name, num_layers=8, num_blocks=32, device="cuda", seed=5)
    # The plan from the strides (blocks on dim 0, as vLLM's views): the view-order
    # check against vLLM's own KVCacheLayout is the CPU suite's (vLLM importable
    # there; the lent GPU machines have none).
    layout = detect_layout(case.layers, kv_cache_layout=None, blocks_per_chunk=4, block_dim=0)
    copier = layout.copier
    ids = [9, 10, 3, 30]
    batched = torch.zeros(layout.chunk_nbytes, dtype=torch.uint8).pin_memory()
    per_layer = torch.zeros_like(batched).pin_memory()
    copier.gather(ids, batched)
    stacked, copier.stacked = copier.stacked, None
    try:
        copier.gather(ids, per_layer)
        torch.cuda.synchronize()
        assert torch.equal(batched, per_layer)
        copier.scatter(batched, [1, 2, 20, 21], first_block=1)
        torch.cuda.synchronize()
        by_layer = [t.clone() for t in case.layers.values()]
    finally:
        copier.stacked = stacked
    for t in case.layers.values():
        t.view(torch.uint8).zero_()
    copier.scatter(batched, [1, 2, 20, 21], first_block=1)
    torch.cuda.synchronize()
    for t, want in zip(case.layers.values(), by_layer, strict=True):
        got = t.view(torch.uint8)[[2, 20, 21]]
        assert torch.equal(got, want.view(torch.uint8)[[2, 20, 21]])
