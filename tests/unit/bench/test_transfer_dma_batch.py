"""``kvstrata bench transfer``'s batched DMA baseline, checked where no GPU is.

The copies the ``dma-batch`` path hands to ``cudaMemcpyBatchAsync`` are
performed here with memmove on CPU tensors of every vLLM layout: they must
write the chunk bytes the torch reference (kvstrata.testing.chunkref) and
the csrc kernels write, so the GPU figure is of the same transfer. On a
machine without CUDA the GPU paths are refused by name.
"""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys

import pytest
import torch

from kvstrata.bench import transfer
from kvstrata.sidecar.transfer.plan import TensorGeometry, plan_from_geometry
from kvstrata.testing import chunkref
from kvstrata.testing.kvlayouts import every_case

PER_CHUNK, CHUNKS = 4, 3


@pytest.mark.parametrize("case", every_case(torch.bfloat16), ids=lambda c: c.name)
def test_the_batched_dma_descriptors_copy_exactly_the_chunks_the_reference_makes(case) -> None:
    plan = plan_from_geometry(
        [TensorGeometry.of(t) for t in case.layers.values()], case.block_dim
    ).coalesced()
    ids = chunkref.random_block_ids(case.num_blocks, CHUNKS * PER_CHUNK, seed=3)
    nbytes = plan.chunk_nbytes(PER_CHUNK)
    out = torch.full((CHUNKS * nbytes,), chunkref.POISON, dtype=torch.uint8)
    chunks = [out.data_ptr() + c * nbytes for c in range(CHUNKS)]

    kv, dst, sizes = transfer.dma_descriptors(plan, ids, chunks, PER_CHUNK)
    for d, s, n in zip(dst, kv, sizes, strict=True):
        ctypes.memmove(d, s, n)

    for c in range(CHUNKS):
        want = chunkref.chunk_bytes(case, ids[c * PER_CHUNK : (c + 1) * PER_CHUNK], 0)
        assert torch.equal(out[c * nbytes : (c + 1) * nbytes], want)


def test_gpu_paths_are_refused_by_name_without_a_cuda_device() -> None:
    from argparse import Namespace

    with pytest.raises(SystemExit, match="dma-batch, ipc need a CUDA device"):
        transfer.wanted_paths(Namespace(param=["paths=torch,dma-batch,ipc"]), cuda=False)
    with pytest.raises(SystemExit, match="unknown"):
        transfer.wanted_paths(Namespace(param=["paths=dma"]), cuda=True)
    assert transfer.wanted_paths(Namespace(param=None), cuda=False) == (
        "torch",
        "torch-per-layer",
        "kernel",
    )
    assert "dma-batch" in transfer.wanted_paths(Namespace(param=None), cuda=True)


@pytest.mark.slow
def test_the_cli_says_which_gpu_paths_a_cpu_run_left_out_and_refuses_asking_for_one() -> None:
    cli = [sys.executable, "-m", "kvstrata", "bench", "transfer", "--quick", "--json"]
    refused = subprocess.run([*cli, "--param", "paths=dma-batch"], capture_output=True, text=True)
    assert refused.returncode != 0
    assert "dma-batch need a CUDA device" in refused.stderr
    done = subprocess.run([*cli, "--param", "paths=kernel"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    record = json.loads(done.stdout)
    assert record["not_measured"] == {p: "needs a CUDA device" for p in transfer.GPU_PATHS}
    assert set(record["layouts"]["LBNHC"]["paths"]) == {"baseline", "kernel"}


def test_the_table_names_each_paths_cost_to_a_matmul_beside_it() -> None:
    # A GPU run's record (the shape kvstrata bench transfer --json writes there).
    row = {"store_gbps": 50.0, "load_gbps": 49.0, "store_vs_baseline": 0.9, "load_vs_baseline": 0.9}
    layout = {
        "paths": {"baseline": row, "kernel": row},
        "matmul_slowdown": 1.27,
        "matmul_slowdown_by_path": {"kernel": 1.27, "kernel-staging": 1.04},
        "errors": {"matmul_slowdown/dma-batch": "RuntimeError: no batched copies"},
    }
    table = transfer.format_table({"device": "cuda", "layouts": {"LBNHC": layout}})
    assert "LBNHC    matmul slowdown beside kernel-staging: 1.04x" in table
    assert "matmul_slowdown/dma-batch not measured: RuntimeError" in table
