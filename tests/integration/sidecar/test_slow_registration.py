"""A KV registration the sidecar answers after the call's deadline turns the
session to ipc mode when its answer comes, instead of leaving it in host
mode for good.

Why it happens: after a sidecar restart the client's re-HELLO resends
REGISTER_KV inside a vLLM step, under the step's call deadline (0.5 s),
while the new sidecar page-locks its arena for the worker's GPU at that
first registration (seconds for tens of GiB). A real server on its own
thread, a real client over its real ZeroMQ socket; the GPU is
:class:`SharedMemoryDevice`, the named test double, held at its opening
until the test releases it (standing in for the page-locking).
"""

from __future__ import annotations

import mmap
import os
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstrata.connector.client import SidecarClient
from kvstrata.sidecar import protocol as p
from kvstrata.sidecar.keys import Namespace
from kvstrata.testing import shmsidecar
from kvstrata.testing.kvlayouts import vllm_layers
from kvstrata.testing.shmdevice import handle_for

GPU_UUID = "GPU-00000000-0000-0000-0000-00000000510w"
NAMESPACE = Namespace(model="slow-registration-test", block_size=16, chunk_size=32)
NUM_BLOCKS = 8


class HeldOpening:
    """Holds the sidecar's GPU opening until released (see the module docstring)."""

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()

    def __call__(self) -> None:
        self.entered.set()
        assert self.release.wait(30), "the test never released the opening"


@pytest.fixture
def held() -> HeldOpening:
    return HeldOpening()


@pytest.fixture
def endpoint(tmp_path: Path, held: HeldOpening) -> Iterator[str]:
    served = shmsidecar.ServedOnThread(tmp_path, GPU_UUID, opening=held)
    yield served.endpoint
    held.release.set()
    served.close()


@pytest.fixture
def registration() -> Iterator[p.RegisterKVRequest]:
    """A REGISTER_KV body for vLLM-shaped KV (LBNHC) in a shared-memory segment."""
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
    layers = [
        p.KVLayerHandle(
            handle=handle_for(name),
            offset=t.data_ptr() - raw.data_ptr(),
            shape=tuple(t.shape),
            strides=tuple(t.stride()),
        )
        for t in case.layers.values()
    ]
    yield p.RegisterKVRequest(
        device_uuid=GPU_UUID, kv_cache_layout="LBNHC", block_dim=0, blocks_per_chunk=2,
        dtype="bfloat16", itemsize=2, layers=layers,
    )  # fmt: skip
    case.layers.clear()
    del raw
    os.unlink(f"/dev/shm/{name}")


def test_a_registration_answered_after_the_deadline_turns_the_session_to_ipc(
    endpoint: str, registration: p.RegisterKVRequest, held: HeldOpening, kit: Any
) -> None:
    client = SidecarClient(
        endpoint, NAMESPACE, role="worker", call_timeout_s=0.5, transfer_mode="ipc"
    )
    try:
        client.register_kv(registration)  # not connected yet: sent at the HELLO
        # The HELLO's call sends REGISTER_KV under its own deadline; the sidecar
        # is still opening the GPU when that passes.
        assert client.ping()
        assert held.entered.is_set()
        assert not client.ipc_granted  # host mode meanwhile ...
        assert "ipc_fallback" not in client.errors  # ... but not refused
        assert client.ipc_fallback_reason == ""

        held.release.set()  # the sidecar finishes and answers; a later call takes it
        kit.wait_until(lambda: client.ping() and client.ipc_granted, 10, "ipc mode granted")
        assert "ipc_fallback" not in client.errors
        assert client.available()  # no back-off was taken for the slow registration
    finally:
        client.close()
