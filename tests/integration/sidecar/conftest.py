"""Fixtures that run real ``kvstrata sidecar`` processes.

Each sidecar gets its own config file in ``tmp_path``: an ``ipc://`` socket
there, a free HTTP port, a small L1 arena and an L2 directory there too.
Readiness is polled on ``/readyz`` with a deadline; teardown stops the
process and removes any shared-memory segment a killed sidecar left behind.
"""

from __future__ import annotations

import contextlib
import sys
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvstrata.connector.client import SidecarClient
from kvstrata.sidecar.keys import ChunkKey, Namespace
from kvstrata.testing.poll import wait_until as wait_until
from kvstrata.testing.servers import RedisServer, ServerError, redis_server_binary
from kvstrata.testing.servers import free_port as free_port
from kvstrata.testing.shmdevice import SharedKV
from kvstrata.testing.sidecarproc import SIDECAR_COMMAND as SIDECAR_COMMAND
from kvstrata.testing.sidecarproc import SidecarProcess
from kvstrata.testing.workers import WORKER_CHUNK as WORKER_CHUNK
from kvstrata.testing.workers import chunk_requests as chunk_requests
from kvstrata.testing.workers import host_worker as host_worker
from kvstrata.testing.workers import worker_settings as worker_settings

START_TIMEOUT_S = 30.0


class Sidecar(SidecarProcess):
    """One sidecar process and the config it runs with."""

    error = AssertionError
    start_timeout_s = START_TIMEOUT_S
    stop_timeout_s = 15.0
    strict_stop = True
    extra_env = {"PYTHONUNBUFFERED": "1"}

    def __init__(self, root: Path, overrides: dict[str, Any] | None = None) -> None:
        super().__init__(
            root,
            chunk_size=16,
            l1_size="16Mi",
            l2_size="256Mi",
            log_level="INFO",
            overrides=overrides,
        )

    def cleanup(self) -> None:
        """SIGKILL (no graceful stop) and unlink the arena segments."""
        self.kill()
        self.remove_arenas()

    def client(self, **kwargs: Any) -> SidecarClient:
        kwargs.setdefault("role", "worker")
        kwargs.setdefault("call_timeout_s", 2.0)
        return SidecarClient(self.endpoint, NAMESPACE, **kwargs)


NAMESPACE = Namespace(model="kvstrata-test-model", block_size=16, chunk_size=16)


def make_keys(n: int, seed: int) -> list[ChunkKey]:
    """``n`` distinct chunk keys of the test namespace (deterministic per seed)."""
    import hashlib

    fp = NAMESPACE.fingerprint()
    return [ChunkKey(fp + hashlib.sha256(f"{seed}/{i}".encode()).digest()) for i in range(n)]


def payload(key: bytes, nbytes: int) -> bytes:
    """Bytes derived from the key, so a retrieve of the wrong chunk shows."""
    import hashlib

    seed = hashlib.sha256(key).digest()
    return (seed * (nbytes // len(seed) + 1))[:nbytes]


def store(
    client: SidecarClient, keys: list[ChunkKey], nbytes: int, owner: str, tenant: str = ""
) -> int:
    """Store ``payload(key)`` for each key through the arena (as ``tenant``'s
    chunks); the number committed."""
    slots = client.prepare_store(keys, nbytes, "uint8", (nbytes,), owner, tenant=tenant)
    assert slots is not None, client.errors
    arena = client.arena
    assert arena is not None
    ids, oks = [], []
    for key, slot in zip(keys, slots, strict=True):
        if slot is None:
            continue
        arena[slot.offset : slot.offset + slot.length] = payload(key, slot.length)
        ids.append(slot.lease_id)
        oks.append(True)
    assert client.commit_store(ids, oks), client.errors
    return len(ids)


def retrieve(client: SidecarClient, keys: list[ChunkKey], owner: str) -> list[bytes | None]:
    """Copy each chunk out of its leased slot, then release the leases."""
    slots = client.prepare_retrieve(keys, owner)
    assert slots is not None, client.errors
    arena = client.arena
    assert arena is not None
    out = [None if s is None else bytes(arena[s.offset : s.offset + s.length]) for s in slots]
    assert client.release([s.lease_id for s in slots if s is not None]), client.errors
    return out


def client_leases(sidecar: Sidecar, client: SidecarClient) -> int:
    """Leases the sidecar holds for this client (from ``/status``)."""
    for entry in sidecar.status()["clients"]:
        if entry["client_id"] == client.client_id:
            return int(entry["leases"])
    raise AssertionError(f"client {client.client_id} has no session")


def empty_step(parked: Sequence[str] = ()) -> Any:
    """What the scheduler role reads of a vLLM SchedulerOutput for a step that
    schedules nothing new (as when vLLM only keeps ``parked`` requests
    waiting for their loads)."""
    cached = SimpleNamespace(
        req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[]
    )
    return SimpleNamespace(
        preempted_req_ids=set(),
        scheduled_new_reqs=[],
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=dict.fromkeys(parked, 0),
    )


STEP_OPS = ("PREPARE_STORE", "COMMIT_STORE", "PREPARE_RETRIEVE", "RELEASE")


def op_counts(sidecar: Sidecar) -> dict[str, float]:
    """Requests the sidecar answered so far, by protocol op (its per-op
    duration histogram's counts on /metrics), for the ops a worker's steps use."""
    counts = dict.fromkeys(STEP_OPS, 0.0)
    for family in text_string_to_metric_families(sidecar.get("/metrics")):
        for sample in family.samples:
            op = sample.labels.get("op")
            if sample.name == "kvstrata_operation_duration_seconds_count" and op in counts:
                counts[op] = sample.value
    return counts


def op_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    return {op: int(after[op] - before[op]) for op in STEP_OPS}


def connections_taken_in(sidecar: Sidecar, listener: str) -> float:
    """Connections ``listener`` accepted that are open now or that it closed
    itself, whatever the reason (from ``/metrics``; on the HTTP port this
    counts the scrape that asks too)."""
    taken = 0.0
    for line in sidecar.get("/metrics").splitlines():
        if line.startswith(
            (
                f'kvstrata_connections_open{{listener="{listener}"}}',
                f'kvstrata_connections_closed_total{{listener="{listener}"',
            )
        ):
            taken += float(line.rsplit(" ", 1)[1])
    return taken


@pytest.fixture
def sidecar_factory(tmp_path: Path) -> Iterator[Callable[..., Sidecar]]:
    made: list[Sidecar] = []

    def make(name: str = "sc", overrides: dict[str, Any] | None = None) -> Sidecar:
        sidecar = Sidecar(tmp_path / name, overrides)
        made.append(sidecar)
        return sidecar

    yield make
    for sidecar in made:
        with contextlib.suppress(AssertionError):
            sidecar.stop()
        sidecar.cleanup()


@pytest.fixture
def sidecar(sidecar_factory: Callable[..., Sidecar]) -> Sidecar:
    return sidecar_factory().start()


def shared_valkey(url: str, **settings: Any) -> dict[str, Any]:
    """The ``shared`` config section for a Valkey at ``url``, under a key prefix
    of its own so that tests sharing a server never read each other's chunks."""
    prefix = f"kvstrata-{uuid.uuid4().hex[:8]}:"
    return {"backend": "valkey", **settings, "valkey": {"url": url, "key_prefix": prefix}}


@pytest.fixture
def valkey_binary() -> None:
    """Fails, not skips, where the Valkey server binary is missing: the shared
    tier's tests must run wherever the suite does."""
    try:
        redis_server_binary()
    except ServerError as exc:
        pytest.fail(f"{exc}; run `make system-deps`")


@pytest.fixture
def valkey(valkey_binary: None, tmp_path: Path) -> Iterator[RedisServer]:
    """A real Valkey-protocol server for the shared tier, stopped after the test."""
    with RedisServer(tmp_path / "valkey") as server:
        yield server


@pytest.fixture
def shared_kv() -> Iterator[Callable[..., SharedKV]]:
    """Makes vLLM-shaped KV in shared-memory segments (``shared_kv(gpu_uuid,
    num_blocks)``) for the in-process ipc tests, and removes each after the test."""
    made: list[SharedKV] = []

    def make(gpu_uuid: str, num_blocks: int = 12) -> SharedKV:
        made.append(SharedKV(gpu_uuid, num_blocks))
        return made[-1]

    yield make
    for kv in made:
        kv.close()


@pytest.fixture(scope="session")
def kit() -> Any:
    """This module's helpers (``kit.store``, ``kit.make_keys``, ``kit.wait_until`` ...):
    test modules cannot import a conftest under ``--import-mode=importlib``."""
    return sys.modules[__name__]
