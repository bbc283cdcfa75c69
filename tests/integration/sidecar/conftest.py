"""Fixtures that run real ``kvstrata sidecar`` processes.

Each sidecar gets its own config file in ``tmp_path``: an ``ipc://`` socket
there, a free HTTP port, a small L1 arena and an L2 directory there too.
Readiness is polled on ``/readyz`` with a deadline; teardown stops the
process and removes any shared-memory segment a killed sidecar left behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvstrata.connector.client import SidecarClient
from kvstrata.sidecar.keys import ChunkKey, Namespace

SIDECAR_COMMAND = [sys.executable, "-m", "kvstrata", "sidecar"]
START_TIMEOUT_S = 30.0


def wait_until(condition: Callable[[], Any], timeout: float, what: str, step: float = 0.02) -> Any:
    """Poll ``condition`` until it is truthy; fail naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(step)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Sidecar:
    """One sidecar process and the config it runs with."""

    def __init__(self, root: Path, overrides: dict[str, Any] | None = None) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.root = root
        self.endpoint = f"ipc://{root}/sidecar.sock"
        self.http_port = free_port()
        config: dict[str, Any] = {
            "chunk_size": 16,
            "log_level": "INFO",
            "l1": {"size_bytes": "16Mi"},
            "l2": {"enabled": True, "path": str(root / "l2"), "size_bytes": "256Mi"},
            "server": {
                "endpoint": self.endpoint,
                "http_host": "127.0.0.1",
                "http_port": self.http_port,
            },
        }
        for section, values in (overrides or {}).items():
            if isinstance(values, dict):
                config.setdefault(section, {}).update(values)
            else:
                config[section] = values
        self.config_path = root / "sidecar.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.log_path = root / "sidecar.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.arena_names: set[str] = set()

    # -- process control ----------------------------------------------------

    def start(self) -> Sidecar:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env = {k: v for k, v in env.items() if not k.startswith("KVSTRATA_")}
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [*SIDECAR_COMMAND, "--config", str(self.config_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        log.close()
        wait_until(self._ready, START_TIMEOUT_S, f"sidecar ready (log {self.log_path})")
        self.arena_names.add(self.status()["arena"]["name"])
        return self

    def _ready(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(f"sidecar exited {self.proc.returncode}: {self.log()}")
        try:
            with urllib.request.urlopen(self.url("/readyz"), timeout=1) as resp:
                return resp.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def stop(self) -> int | None:
        """SIGTERM and wait; the exit code."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"sidecar ignored SIGTERM: {self.log()}") from None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def cleanup(self) -> None:
        self.kill()
        for name in self.arena_names:  # a killed sidecar cannot unlink its segment
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"/dev/shm/{name}")

    # -- observation ----------------------------------------------------------

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.http_port}{path}"

    def get(self, path: str) -> str:
        with urllib.request.urlopen(self.url(path), timeout=5) as resp:
            return resp.read().decode()

    def status(self) -> dict[str, Any]:
        return json.loads(self.get("/status"))

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

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


def store(client: SidecarClient, keys: list[ChunkKey], nbytes: int, owner: str) -> int:
    """Store ``payload(key)`` for each key through the arena; the number committed."""
    slots = client.prepare_store(keys, nbytes, "uint8", (nbytes,), owner)
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


@pytest.fixture(scope="session")
def kit() -> Any:
    """This module's helpers (``kit.store``, ``kit.make_keys``, ``kit.wait_until`` ...):
    test modules cannot import a conftest under ``--import-mode=importlib``."""
    return sys.modules[__name__]
