"""ipc mode's SAVE_BLOCKS names its chunks' tenant like PREPARE_STORE: the
sidecar's copies are charged to it and kept by its rules (the stand-in GPU of
test_ipc_mode: real server, real client, real ZeroMQ sockets)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvstrata.connector.client import SidecarClient
from kvstrata.sidecar import protocol as p
from kvstrata.sidecar.keys import ChunkKey, Namespace
from kvstrata.sidecar.transfer_mode import TransferMode
from kvstrata.testing.shmdevice import SharedKV
from kvstrata.testing.shmsidecar import ServedOnThread

GPU_UUID = "GPU-00000000-0000-0000-0000-0000tenants"
NAMESPACE = Namespace(model="ipc-tenants", block_size=16, chunk_size=32)
TENANTS = [
    {"name": "private", "match": {"cache_salts": ["p"]}, "memory_only": True},
    {"name": "never", "match": {"cache_salts": ["n"]}, "budgets": {"l1_bytes": 0}},
]


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[ServedOnThread]:
    sc = ServedOnThread(tmp_path, GPU_UUID, tenants=TENANTS)
    yield sc
    sc.close()


def keys(n: int, tag: str) -> list[ChunkKey]:
    fp = NAMESPACE.fingerprint()
    return [ChunkKey(fp + hashlib.sha256(f"{tag}/{i}".encode()).digest()) for i in range(n)]


def test_save_blocks_keeps_each_tenants_chunks_by_its_rules(
    sidecar: ServedOnThread, shared_kv: Callable[..., SharedKV]
) -> None:
    kv = shared_kv(GPU_UUID)
    client = SidecarClient(
        sidecar.endpoint,
        NAMESPACE,
        role="worker",
        call_timeout_s=5.0,
        transfer_mode=TransferMode.IPC,
    )
    try:
        client.register_kv(kv.registration())
        private, never, plain = keys(1, "private"), keys(1, "never"), keys(1, "plain")
        assert client.ipc.save_blocks(private, [[1, 2]], None, "r", tenant="private") == [True]
        assert client.ipc.save_blocks(never, [[3, 4]], None, "r", tenant="never") == [False]
        assert client.ipc.save_blocks(plain, [[5, 6]], None, "r") == [True]
        assert client.ipc.save_blocks(plain, [[5, 6]], None, "r", tenant="nobody") is None
        assert client.errors.get(p.E_BAD_REQUEST) == 1

        engine = sidecar.engine
        assert engine.flush(timeout=30)
        assert engine.l2 is not None
        assert engine.l2.contains(plain[0]) and not engine.l2.contains(private[0])
        tenants = engine.stats().tenants
        assert tenants.l1_bytes["private"] == tenants.l1_bytes["default"] > 0
        assert tenants.refusals == {("never", "l1", "not_kept"): 1}
    finally:
        client.close()
