"""The connector's worker role through a real sidecar, with KV tensors built
like every vLLM GPU layout (CPU tensors with the GPU shapes and strides).

Save blocks from one place, load them into poisoned blocks elsewhere, and
compare bytes with the source read by plain indexing. No vLLM engine runs
here; the worker is the same object vLLM drives.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvstrata.connector.layout import layout_id
from kvstrata.connector.metadata import ChunkTransfer, KVStrataMetadata, RequestTransfer
from kvstrata.connector.settings import ConnectorSettings
from kvstrata.connector.worker import KVStrataWorker
from kvstrata.testing.kvlayouts import DTYPES, KVLayoutCase, every_case
from kvstrata.testing.workers import WORKER_BLOCK_SIZE, case_settings

BLOCK_SIZE = WORKER_BLOCK_SIZE  # the block size case_settings gives
BLOCKS_PER_CHUNK = 2
POISON = 0xA5
CASES = [case for dtype in DTYPES for case in every_case(dtype)]


@pytest.fixture(scope="module")
def sidecar(kit: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    sc = kit.Sidecar(tmp_path_factory.mktemp("layouts"), {"l1": {"size_bytes": "64Mi"}})
    sc.start()
    yield sc
    sc.stop()
    sc.cleanup()


def settings_for(endpoint: str, case: KVLayoutCase, layout: str | None = None) -> ConnectorSettings:
    return case_settings(endpoint, case, "layout-test", layout, kv_dtype=case.name)


def worker_for(endpoint: str, case: KVLayoutCase, layout: str | None = None) -> KVStrataWorker:
    worker = KVStrataWorker(settings_for(endpoint, case, layout), None)  # type: ignore[arg-type]
    worker.register_kv_caches(case.layers)
    assert worker.layout is not None, case.name
    return worker


def block_bytes(case: KVLayoutCase, kv: torch.Tensor, block: int) -> torch.Tensor:
    return kv.select(case.block_dim, block).contiguous().view(torch.uint8).flatten()


def poison(case: KVLayoutCase, blocks: list[int]) -> None:
    for kv in case.layers.values():
        for b in blocks:
            kv.select(case.block_dim, b).view(torch.uint8).fill_(POISON)


def chunk_hashes(case: KVLayoutCase, n: int, test: str) -> list[bytes]:
    return [hashlib.sha256(f"{test}/{case.name}/{i}".encode()).digest() for i in range(n)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_blocks_saved_through_the_sidecar_load_back_byte_for_byte(
    sidecar: Any, case: KVLayoutCase
) -> None:
    worker = worker_for(sidecar.endpoint, case)
    try:
        src = [[3, 4], [9, 1]]
        dst = [[6, 7], [0, 11]]
        hashes = chunk_hashes(case, 2, "round-trip")
        saves = [ChunkTransfer(h, b) for h, b in zip(hashes, src, strict=True)]
        worker.save(KVStrataMetadata(saves=[RequestTransfer("save", saves)]))
        assert worker.counters.saved_chunks == 2, worker.client.errors

        poison(case, [b for blocks in dst for b in blocks])
        loads = [ChunkTransfer(h, b) for h, b in zip(hashes, dst, strict=True)]
        worker.start_load(KVStrataMetadata(loads=[RequestTransfer("load", loads)]))
        worker.save(None)  # end of the step: load copies finished, leases released
        assert worker.take_load_errors() == set()
        assert worker.counters.loaded_chunks == 2
        for name, kv in case.layers.items():
            for s_blocks, d_blocks in zip(src, dst, strict=True):
                for s, d in zip(s_blocks, d_blocks, strict=True):
                    assert torch.equal(block_bytes(case, kv, d), block_bytes(case, kv, s)), name
    finally:
        worker.close()


def test_a_chunk_saved_under_one_layout_is_a_miss_under_another(sidecar: Any) -> None:
    case = every_case(torch.bfloat16)[0]  # vLLM LBHNC
    saver = worker_for(sidecar.endpoint, case)
    other = worker_for(sidecar.endpoint, case, layout=layout_id("cuda", "LBNHC", None))
    try:
        hashes = chunk_hashes(case, 1, "other-layout")
        saver.save(
            KVStrataMetadata(saves=[RequestTransfer("s", [ChunkTransfer(hashes[0], [2, 5])])])
        )
        assert saver.counters.saved_chunks == 1
        poison(case, [8, 10])
        load = RequestTransfer("l", [ChunkTransfer(hashes[0], [8, 10])])
        other.start_load(KVStrataMetadata(loads=[load]))
        other.save(None)
        assert other.take_load_errors() == {8, 10}
        for kv in case.layers.values():
            assert torch.all(block_bytes(case, kv, 8) == POISON)
    finally:
        saver.close()
        other.close()
