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

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstrata.connector.client import SidecarClient
from kvstrata.sidecar import protocol as p
from kvstrata.sidecar.keys import Namespace
from kvstrata.sidecar.transfer_mode import TransferMode
from kvstrata.testing import shmsidecar
from kvstrata.testing.shmdevice import SharedKV

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
def registration(shared_kv: Callable[..., SharedKV]) -> p.RegisterKVRequest:
    """A REGISTER_KV body for vLLM-shaped KV (LBNHC) in a shared-memory segment."""
    return shared_kv(GPU_UUID, NUM_BLOCKS).registration()


def test_a_registration_answered_after_the_deadline_turns_the_session_to_ipc(
    endpoint: str, registration: p.RegisterKVRequest, held: HeldOpening, kit: Any
) -> None:
    client = SidecarClient(
        endpoint, NAMESPACE, role="worker", call_timeout_s=0.5, transfer_mode=TransferMode.IPC
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


def test_a_connect_with_a_registrations_deadline_waits_for_it_that_call_only(
    endpoint: str, registration: p.RegisterKVRequest, held: HeldOpening
) -> None:
    """The worker connects with the patience of a first registration
    (``connect(timeout_s=...)``): the sidecar's answer, held until the test
    lets it go, arrives within that call, which then grants ipc mode; the
    client's own deadline, for every other call, is unchanged."""
    client = SidecarClient(
        endpoint, NAMESPACE, role="worker", call_timeout_s=0.5, transfer_mode=TransferMode.IPC
    )
    # Let the opening go once the sidecar is in it: ordered by the event, so
    # the answer comes after the HELLO's call has started waiting for it.
    releaser = threading.Thread(target=lambda: held.entered.wait(30) and held.release.set())
    releaser.start()
    try:
        client.register_kv(registration)
        assert client.connect(timeout_s=60.0)
        assert held.entered.is_set()
        assert client.ipc_granted  # answered inside this call's own deadline
        assert "timeout" not in client.errors
        assert client.call_timeout_s == 0.5
    finally:
        held.release.set()
        releaser.join()
        client.close()
