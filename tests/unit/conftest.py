"""Shared fixtures of the engine unit tests: small configs in ``tmp_path``."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstrata.sidecar.config import SidecarConfig, config_from_dict
from kvstrata.sidecar.engine import StorageManager


def make_key(i: int, ns: bytes = b"\x01" * 16) -> bytes:
    """A 48-byte chunk key: namespace fingerprint + a hash of ``i``."""
    return ns + hashlib.sha256(str(i).encode()).digest()


def payload_for(key: bytes, nbytes: int) -> bytes:
    """Bytes derived from the key, so any mix-up is detectable."""
    seed = hashlib.sha256(key).digest()
    return (seed * (nbytes // len(seed) + 1))[:nbytes]


def engine_config(tmp_path: Path, **sections: Any) -> SidecarConfig:
    data: dict[str, Any] = {
        "l1": {"size_bytes": "1Mi", "pin_memory": False},
        "l2": {"path": str(tmp_path / "l2"), "size_bytes": "4Mi"},
    }
    for name, values in sections.items():
        data[name] = {**data.get(name, {}), **values}
    return config_from_dict(data)


@pytest.fixture
def make_engine(tmp_path: Path) -> Iterator[Callable[..., StorageManager]]:
    engines: list[StorageManager] = []

    def build(**sections: Any) -> StorageManager:
        engine = StorageManager(engine_config(tmp_path, **sections))
        engines.append(engine)
        return engine

    yield build
    for engine in engines:
        engine.close()
