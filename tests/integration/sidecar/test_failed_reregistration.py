"""A refused REGISTER_KV leaves the registration that worked in place.

A real server on its own thread, a raw peer over its real ZeroMQ socket.
No GPU here: the sidecar's device is :class:`SharedMemoryDevice`, the named
test double whose "IPC handles" name shared-memory segments and whose copies
run the host build of the csrc kernels (as in ``test_ipc_mode.py``)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstrata.sidecar import protocol as p
from kvstrata.sidecar.keys import ChunkKey, Namespace
from kvstrata.testing import shmsidecar
from kvstrata.testing.rawpeer import RawPeer
from kvstrata.testing.shmdevice import SharedKV, SharedMemoryDevice

GPU_UUID = "GPU-00000000-0000-0000-0000-0000000026dd"
NAMESPACE = Namespace(model="reregistration-test", block_size=16, chunk_size=32)
NUM_BLOCKS = 8


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[str, SharedMemoryDevice]]:
    sidecar = shmsidecar.ServedOnThread(tmp_path, GPU_UUID)
    yield sidecar.endpoint, sidecar.device
    sidecar.close()


@pytest.fixture
def kv(shared_kv: Callable[..., SharedKV]) -> SharedKV:
    """vLLM-shaped KV (layout LBNHC) inside a shared-memory segment."""
    return shared_kv(GPU_UUID, NUM_BLOCKS)


def _key(tag: str) -> bytes:
    return bytes(ChunkKey(NAMESPACE.fingerprint() + hashlib.sha256(tag.encode()).digest()))


def test_a_refused_reregistration_keeps_the_one_that_worked(served: Any, kv: SharedKV):
    endpoint, device = served
    peer = RawPeer(endpoint)
    peer.hello(NAMESPACE.fingerprint(), transfer_mode="ipc")
    reply = peer.call(p.REGISTER_KV, kv.registration(blocks_per_chunk=2).to_wire())
    assert reply[2] is True, reply
    save = {"keys": [_key("a")], "block_ids": [[1, 2]], "owner": "r"}
    assert peer.call(p.SAVE_BLOCKS, save)[3] == {"committed": [True]}

    # A chunk of 8 Mi blocks cannot fit the arena: refused after the handles were opened.
    _, _, ok, body = peer.call(p.REGISTER_KV, kv.registration(blocks_per_chunk=4096).to_wire())
    assert (ok, body["code"]) == (False, p.E_BAD_REQUEST)
    assert device.open_handles == 1  # the refused one's handles closed, the first kept

    # On 4edd4cb the refusal had closed the first registration: "send REGISTER_KV first".
    save = {"keys": [_key("b")], "block_ids": [[3, 4]], "owner": "r"}
    _, _, ok, body = peer.call(p.SAVE_BLOCKS, save)
    assert (ok, body) == (True, {"committed": [True]}), body
    peer.close()
