"""How ``kvstrata sidecar`` decides whether it serves ipc mode (``transfer_mode``).

The GPU factory is replaced here (the real one is tested in
tests/unit/transfer/test_cuda_device.py and on GPUs by the selftest); what is checked is the
decision, the reason clients are given, and how loudly it is logged.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstrata.sidecar import main
from kvstrata.sidecar.config import config_from_dict
from kvstrata.sidecar.engine import StorageManager
from kvstrata.sidecar.transfer import cuda_device
from kvstrata.sidecar.transfer.ipc import IpcTransfers


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[StorageManager]:
    config = config_from_dict(
        {
            "l1": {"size_bytes": "1Mi", "pin_memory": False},
            "l2": {"path": str(tmp_path / "l2"), "size_bytes": "1Mi"},
        }
    )
    sm = StorageManager(config)
    yield sm
    sm.close()


def config_with(mode: str) -> Any:
    return config_from_dict({"transfer_mode": mode})


def no_gpu(arena: Any, **_: Any) -> tuple[None, str]:
    return None, "CUDA kernels unavailable: no CUDA device (test)"


def test_transfer_mode_host_never_opens_a_gpu(
    engine: StorageManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    def must_not_be_called(arena: Any, **_: Any) -> Any:
        raise AssertionError("host mode opened the GPU")

    monkeypatch.setattr(cuda_device, "open_cuda_devices", must_not_be_called)
    devices, ipc, reason = main._open_ipc(config_with("host"), engine)
    assert devices is None and ipc is None
    assert "transfer_mode host" in reason


@pytest.mark.parametrize("mode,level", [("ipc", logging.WARNING), ("auto", logging.INFO)])
def test_without_a_gpu_clients_are_told_why_and_an_explicit_ipc_warns(
    engine: StorageManager,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    mode: str,
    level: int,
) -> None:
    monkeypatch.setattr(cuda_device, "open_cuda_devices", no_gpu)
    with caplog.at_level(logging.DEBUG, logger="kvstrata.sidecar"):
        devices, ipc, reason = main._open_ipc(config_with(mode), engine)
    assert devices is None and ipc is None
    assert reason == "CUDA kernels unavailable: no CUDA device (test)"
    (record,) = [r for r in caplog.records if "ipc unavailable" in r.getMessage()]
    assert record.levelno == level
    assert reason in record.getMessage()


def test_with_a_gpu_the_sidecar_serves_ipc_through_the_factory(
    engine: StorageManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    factory = object()
    seen: list[Any] = []

    def with_gpu(arena: Any, **_: Any) -> tuple[Any, str]:
        seen.append(arena)
        return factory, ""

    monkeypatch.setattr(cuda_device, "open_cuda_devices", with_gpu)
    devices, ipc, reason = main._open_ipc(config_with("auto"), engine)
    assert devices is factory
    assert isinstance(ipc, IpcTransfers)
    assert seen == [engine.arena]
    assert reason == ""


def test_the_gpus_are_opened_with_the_configured_copy_path_and_staging_size(
    engine: StorageManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[dict[str, Any]] = []

    def staging(arena: Any, **kwargs: Any) -> tuple[None, str]:
        asked.append(kwargs)
        return None, "no GPU (test)"

    monkeypatch.setattr(cuda_device, "open_cuda_devices", staging)
    config = config_from_dict({"ipc": {"copy_path": "staging", "staging_bytes": "32Mi"}})
    main._open_ipc(config, engine)
    assert asked == [{"copy_path": "staging", "staging_bytes": 32 << 20, "max_ctas": 0}]


def test_the_copy_kernels_thread_blocks_are_capped_by_ipc_max_ctas(
    engine: StorageManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[dict[str, Any]] = []

    def opened(arena: Any, **kwargs: Any) -> tuple[None, str]:
        asked.append(kwargs)
        return None, "no GPU (test)"

    monkeypatch.setattr(cuda_device, "open_cuda_devices", opened)
    main._open_ipc(config_from_dict({"ipc": {"max_ctas": 8}}), engine)
    assert asked[0]["max_ctas"] == 8


@pytest.mark.parametrize("value", [-1, 70000, "many"])
def test_a_bad_ipc_max_ctas_is_refused_naming_the_key(value: Any) -> None:
    from kvstrata.sidecar.config import ConfigError

    with pytest.raises(ConfigError, match=r"ipc\.max_ctas"):
        config_from_dict({"ipc": {"max_ctas": value}})
