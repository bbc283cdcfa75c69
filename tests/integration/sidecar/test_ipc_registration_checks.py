"""What a worker registers and saves in ipc mode, checked by a real sidecar process.

The sidecar runs in its own process (:mod:`kvstrata.testing.shmsidecar`),
reached over real ZeroMQ; its GPU is the shared-memory stand-in (a test
double whose copies are the host build of the csrc kernels), so a copy past
a mapping is a SIGSEGV of that process here as it would be an illegal
address on a GPU. Nothing a client registers or saves may take it down or
commit bytes that were never written.
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvstrata.connector.client import SidecarClient
from kvstrata.sidecar import protocol as p
from kvstrata.sidecar.keys import ChunkKey, Namespace
from kvstrata.sidecar.transfer_mode import TransferMode
from kvstrata.testing.kvlayouts import vllm_layers
from kvstrata.testing.shmdevice import handle_for

GPU_UUID = "GPU-00000000-0000-0000-0000-0000000check"
NAMESPACE = Namespace(model="ipc-checks", block_size=16, chunk_size=32)
HEADS, TOKENS, CONTENT = 2, 16, 128  # bf16: a block of one layer is 8 KiB
BLOCK_BYTES = HEADS * TOKENS * CONTENT * 2


class SidecarProcess:
    def __init__(self, root: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvstrata.testing.shmsidecar", str(root), GPU_UUID],
            stdout=subprocess.PIPE,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().decode().split()  # b"" if it died
        assert line[:1] == ["ready"], f"the sidecar did not start: {line}"
        self.endpoint = line[1]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def client(self) -> SidecarClient:
        return SidecarClient(
            self.endpoint,
            NAMESPACE,
            role="worker",
            call_timeout_s=5.0,
            transfer_mode=TransferMode.IPC,
        )

    def stop(self) -> None:
        if self.alive():
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


class Segment:
    """A named shared-memory segment: the stand-in for one CUDA allocation."""

    def __init__(self, nbytes: int) -> None:
        self.name = f"kvstrata-check-{uuid.uuid4().hex[:12]}"
        fd = os.open(f"/dev/shm/{self.name}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            self.mm = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        self.raw = torch.frombuffer(self.mm, dtype=torch.int8)

    def close(self) -> None:
        # Views of the mapping may outlive the test (a failure's traceback holds
        # them): unlink the name only; the pages go with the last reference.
        os.unlink(f"/dev/shm/{self.name}")


@contextlib.contextmanager
def worker_on(
    sidecar: SidecarProcess, nbytes: int = 3 * 12 * BLOCK_BYTES
) -> Iterator[tuple[Segment, SidecarClient]]:
    """A stand-in allocation and an ipc-mode worker client of ``sidecar``,
    both closed after the test's body."""
    segment = Segment(nbytes)
    try:
        client = sidecar.client()
        try:
            yield segment, client
        finally:
            client.close()
    finally:
        segment.close()


def registration(
    segment: Segment,
    layers: list[torch.Tensor],
    *,
    blocks_per_chunk: int = 2,
    num_blocks: int = 0,
    mapped_nbytes: int = 0,
) -> p.RegisterKVRequest:
    base = segment.raw.data_ptr()
    # Only the fields a case sets, so each case shows its own point.
    sizes = {"mapped_nbytes": mapped_nbytes} if mapped_nbytes else {}
    blocks = {"num_blocks": num_blocks} if num_blocks else {}
    return p.RegisterKVRequest(
        device_uuid=GPU_UUID,
        kv_cache_layout="LBNHC",
        block_dim=0,
        blocks_per_chunk=blocks_per_chunk,
        dtype="bfloat16",
        itemsize=2,
        layers=[
            p.KVLayerHandle(
                handle=handle_for(segment.name),
                offset=t.data_ptr() - base,
                shape=tuple(t.shape),
                strides=tuple(t.stride()),
                **sizes,
            )
            for t in layers
        ],
        **blocks,
    )


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).flatten()


def keys(n: int, tag: str) -> list[ChunkKey]:
    fp = NAMESPACE.fingerprint()
    return [ChunkKey(fp + hashlib.sha256(f"{tag}/{i}".encode()).digest()) for i in range(n)]


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[SidecarProcess]:
    sc = SidecarProcess(tmp_path)
    yield sc
    sc.stop()


def kv_in(segment: Segment, num_blocks: int = 12) -> list[torch.Tensor]:
    case = vllm_layers(
        "LBNHC", num_blocks=num_blocks, heads=HEADS, tokens=TOKENS, content=CONTENT,
        buffer=segment.raw,
    )  # fmt: skip
    return list(case.layers.values())


def test_a_registration_claiming_more_blocks_than_its_allocation_is_refused_and_the_sidecar_lives(
    sidecar: SidecarProcess,
) -> None:
    small = Segment(BLOCK_BYTES)  # 8 KiB: one block of one layer
    try:
        # [B, H, N, C] of bf16, dense: 1,000,000 blocks of 8 KiB claimed.
        claim = p.KVLayerHandle(
            handle=handle_for(small.name),
            offset=0,
            shape=(1_000_000, HEADS, TOKENS, CONTENT),
            strides=(HEADS * TOKENS * CONTENT, TOKENS * CONTENT, CONTENT, 1),
        )
        body = p.RegisterKVRequest(
            device_uuid=GPU_UUID,
            kv_cache_layout="LBNHC",
            block_dim=0,
            blocks_per_chunk=2,
            dtype="bfloat16",
            itemsize=2,
            layers=[claim],
        )
        client = sidecar.client()
        try:
            client.register_kv(body)
            assert client.stats() is not None
            assert client.transfer_mode is TransferMode.HOST
            assert "past the 8192 bytes mapped" in client.ipc_fallback_reason
            # No registration: the copy the claim would have allowed is refused.
            assert client.ipc.save_blocks(keys(1, "far"), [[999_999, 999_998]], None, "r") is None
            assert sidecar.alive()
            assert client.ping()
        finally:
            client.close()
    finally:
        small.close()
    assert sidecar.alive()


def test_a_registration_past_what_the_worker_says_it_shares_is_refused(
    sidecar: SidecarProcess,
) -> None:
    with worker_on(sidecar) as (segment, client):
        # The worker's storage ends one block before the tensors do.
        too_short = 3 * 12 * BLOCK_BYTES - BLOCK_BYTES
        client.register_kv(registration(segment, kv_in(segment), mapped_nbytes=too_short))
        assert client.stats() is not None
        assert client.transfer_mode is TransferMode.HOST
        assert f"past the {too_short} bytes mapped" in client.ipc_fallback_reason


def test_a_save_that_names_no_block_is_refused_and_commits_nothing(
    sidecar: SidecarProcess,
) -> None:
    with worker_on(sidecar) as (segment, client):
        client.register_kv(registration(segment, kv_in(segment)))
        assert client.stats() is not None and client.transfer_mode is TransferMode.IPC
        never_written = keys(1, "unwritten")
        assert client.ipc.save_blocks(never_written, [[-1, -1]], None, "r") is None
        assert client.ipc.save_blocks(keys(1, "half"), [[3, -1]], None, "r") is None
        assert client.errors.get(p.E_BAD_REQUEST) == 2
        # Nothing was committed under those keys: a load finds nothing.
        assert client.ipc.load_blocks(never_written, [[0, 1]], "r2") == 0
        assert client.ipc.load_blocks(keys(1, "half"), [[0, 1]], "r2") == 0
        # The session keeps serving real saves.
        assert client.ipc.save_blocks(keys(1, "real"), [[3, 4]], None, "r") == [True]
        assert sidecar.alive()


def test_split_kernel_blocks_are_planned_per_vllm_block(sidecar: SidecarProcess) -> None:
    # vLLM's attention kernels split each of its 6 blocks in two: the tensors
    # have 12 kernel blocks, the worker names vLLM's blocks (0..5).
    with worker_on(sidecar) as (segment, client):
        layers = kv_in(segment)
        client.register_kv(registration(segment, layers, blocks_per_chunk=1, num_blocks=6))
        assert client.stats() is not None and client.transfer_mode is TransferMode.IPC
        ks = keys(2, "split")
        assert client.ipc.save_blocks(ks, [[1], [4]], None, "r") == [True, True]
        for t in layers:
            for kernel_block in (0, 1, 10, 11):
                t[kernel_block].view(torch.uint8).fill_(0x5A)
        assert client.ipc.load_blocks(ks, [[0], [5]], "r2") == 2
        for t in layers:
            # vLLM block 1 = kernel blocks 2, 3; block 4 = 8, 9; 0 = 0, 1; 5 = 10, 11.
            for src, dst in ((2, 0), (3, 1), (8, 10), (9, 11)):
                assert torch.equal(as_bytes(t[dst]), as_bytes(t[src]))
        assert client.ipc.save_blocks(keys(1, "past"), [[6]], None, "r") is None  # 6 vLLM blocks


def test_kernel_blocks_that_do_not_divide_into_vllm_blocks_are_refused(
    sidecar: SidecarProcess,
) -> None:
    with worker_on(sidecar) as (segment, client):
        client.register_kv(registration(segment, kv_in(segment), num_blocks=5))
        assert client.stats() is not None
        assert client.transfer_mode is TransferMode.HOST
        assert "12 kernel blocks for 5 cache blocks" in client.ipc_fallback_reason


def test_a_sidecar_planning_other_chunks_than_the_worker_leaves_it_in_host_mode(
    sidecar: SidecarProcess,
) -> None:
    with worker_on(sidecar) as (segment, client):
        body = registration(segment, kv_in(segment))
        body.chunk_nbytes = 3 * 2 * BLOCK_BYTES * 2  # the worker's split-block chunk
        client.register_kv(body)
        assert client.stats() is not None
        assert client.transfer_mode is TransferMode.HOST
        assert "chunk_nbytes" in client.ipc_fallback_reason
