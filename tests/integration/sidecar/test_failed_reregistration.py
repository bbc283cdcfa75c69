"""A refused REGISTER_KV leaves the registration that worked in place.

A real server on its own thread, a raw peer over its real ZeroMQ socket.
No GPU here: the sidecar's device is :class:`SharedMemoryDevice`, the named
test double whose "IPC handles" name shared-memory segments and whose copies
run the host build of the csrc kernels (as in ``test_ipc_mode.py``)."""

from __future__ import annotations

import hashlib
import mmap
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstrata.sidecar import protocol as p
from kvstrata.sidecar.keys import ChunkKey, Namespace
from kvstrata.testing import shmsidecar
from kvstrata.testing.kvlayouts import vllm_layers
from kvstrata.testing.rawpeer import RawPeer
from kvstrata.testing.shmdevice import SharedMemoryDevice, handle_for

GPU_UUID = "GPU-00000000-0000-0000-0000-0000000026dd"
NAMESPACE = Namespace(model="reregistration-test", block_size=16, chunk_size=32)
NUM_BLOCKS = 8


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[str, SharedMemoryDevice]]:
    sidecar = shmsidecar.ServedOnThread(tmp_path, GPU_UUID)
    yield sidecar.endpoint, sidecar.device
    sidecar.close()


@pytest.fixture
def kv_segment() -> Iterator[tuple[str, Any]]:
    """vLLM-shaped KV (layout LBNHC) inside a shared-memory segment."""
    name = f"kvstrata-test-kv-{uuid.uuid4().hex[:12]}"
    nbytes = 3 * NUM_BLOCKS * 2 * 16 * 128 * 2  # layers, blocks, heads, tokens, bf16 content
    fd = os.open(f"/dev/shm/{name}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        mm = mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
    raw = torch.frombuffer(mm, dtype=torch.int8)
    case = vllm_layers("LBNHC", num_blocks=NUM_BLOCKS, heads=2, tokens=16, content=128, buffer=raw)
    layers = [  # on the wire: [handle, offset, shape, strides]
        [handle_for(name), t.data_ptr() - raw.data_ptr(), list(t.shape), list(t.stride())]
        for t in case.layers.values()
    ]
    yield name, layers
    case.layers.clear()
    del raw
    os.unlink(f"/dev/shm/{name}")


def _registration(layers: list[Any], blocks_per_chunk: int) -> dict[str, Any]:
    return {"device_uuid": GPU_UUID, "kv_cache_layout": "LBNHC", "block_dim": 0,
            "blocks_per_chunk": blocks_per_chunk, "dtype": "bfloat16", "itemsize": 2,
            "layers": layers}  # fmt: skip


def _key(tag: str) -> bytes:
    return bytes(ChunkKey(NAMESPACE.fingerprint() + hashlib.sha256(tag.encode()).digest()))


def test_a_refused_reregistration_keeps_the_one_that_worked(served: Any, kv_segment: Any):
    endpoint, device = served
    _, layers = kv_segment
    peer = RawPeer(endpoint)
    peer.hello(NAMESPACE.fingerprint(), transfer_mode="ipc")
    reply = peer.call(p.REGISTER_KV, _registration(layers, 2))
    assert reply[2] is True, reply
    save = {"keys": [_key("a")], "block_ids": [[1, 2]], "owner": "r"}
    assert peer.call(p.SAVE_BLOCKS, save)[3] == {"committed": [True]}

    # A chunk of 8 Mi blocks cannot fit the arena: refused after the handles were opened.
    _, _, ok, body = peer.call(p.REGISTER_KV, _registration(layers, 4096))
    assert (ok, body["code"]) == (False, p.E_BAD_REQUEST)
    assert device.open_handles == 1  # the refused one's handles closed, the first kept

    # On 4edd4cb the refusal had closed the first registration: "send REGISTER_KV first".
    save = {"keys": [_key("b")], "block_ids": [[3, 4]], "owner": "r"}
    _, _, ok, body = peer.call(p.SAVE_BLOCKS, save)
    assert (ok, body) == (True, {"committed": [True]}), body
    peer.close()
