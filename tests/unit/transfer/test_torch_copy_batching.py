"""The torch copier moves every layer of a run of blocks in one call when the
layers are cut from one buffer (vLLM >= 0.32), with the same bytes as one
call per layer.

Why: host mode on a GPU copies with it, from Python; one ``copy_`` per
(layer x run of consecutive blocks) -- 32 layers x 16 shuffled blocks, 512
calls a chunk -- cost more than the bytes on small blocks. The calls are
counted with torch's own dispatch hook (``TorchDispatchMode``), which sees
every ``copy_`` whichever path issues it.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvstrata.connector.layout import detect_layout
from kvstrata.testing.kvlayouts import DTYPES, every_case, vllm_layers

CASES = [case for dtype in DTYPES for case in every_case(dtype)]
POISON = 0xA5


class CountedCopies(TorchDispatchMode):
    """Counts the ``aten.copy_`` calls made inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.copies = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten.copy_.default:
            self.copies += 1
        return func(*args, **(kwargs or {}))


def raw(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes (random KV holds NaNs, which no float compare calls equal)."""
    return t.contiguous().view(torch.uint8).clone()


@pytest.mark.parametrize("layout_name", ["LBNHC", "BLNHC"])
def test_layers_cut_from_one_buffer_move_in_one_copy_per_run_of_blocks(layout_name: str) -> None:
    case = vllm_layers(layout_name, num_layers=32, num_blocks=64, heads=2, tokens=4, content=16)
    layout = detect_layout(case.layers, kv_cache_layout=layout_name, blocks_per_chunk=16)
    ids = random.Random(7).sample(range(64), 16)  # vLLM's free list: mostly no runs
    n_runs = sum(1 for i, b in enumerate(ids) if i == 0 or ids[i - 1] + 1 != b)
    buf = torch.empty(layout.chunk_nbytes, dtype=torch.uint8)
    with CountedCopies() as counted:
        layout.copier.gather(ids, buf)
        layout.copier.scatter(buf, ids)
    assert counted.copies == 2 * n_runs  # not 2 x 32 layers x runs


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_one_call_per_run_moves_the_same_bytes_as_one_call_per_layer(case: Any) -> None:
    layout = detect_layout(
        case.layers,
        kv_cache_layout=case.kv_cache_layout,
        blocks_per_chunk=4,
        block_dim=case.block_dim,
    )
    copier = layout.copier
    ids = [6, 7, 2, -1]  # a run, a lone block, a skipped position
    batched = torch.full((layout.chunk_nbytes,), POISON, dtype=torch.uint8)
    per_layer = batched.clone()
    copier.gather(ids, batched)
    stacked, copier.stacked = copier.stacked, None  # the one-call-per-layer path
    try:
        copier.gather(ids, per_layer)
        assert torch.equal(batched, per_layer)
        before = {n: t.clone() for n, t in case.layers.items()}
        copier.scatter(batched, [9, 10, 3, 4], first_block=1)
        by_layer = {n: raw(t) for n, t in case.layers.items()}
        for name, t in case.layers.items():
            t.copy_(before[name])
    finally:
        copier.stacked = stacked
    copier.scatter(batched, [9, 10, 3, 4], first_block=1)
    for name, t in case.layers.items():
        assert torch.equal(raw(t), by_layer[name]), name
