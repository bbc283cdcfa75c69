"""Config that is wrong says so: the sidecar exits naming the setting and the
value it was given, never serving somewhere else or failing with an errno."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path
from typing import Any

import pytest

FIELD_EXIT = 2  # refused by the config loader
START_EXIT = 1  # valid config the machine cannot honour


def _run(kit: Any, sidecar: Any, args: list[str]) -> subprocess.CompletedProcess:
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("KVSTRATA_")}
    return subprocess.run(
        [*kit.SIDECAR_COMMAND, "--config", str(sidecar.config_path), *args],
        capture_output=True,
        text=True,
        timeout=30,  # a sidecar that starts anyway never exits: that is a failure
        env=inherited,
    )


@pytest.mark.parametrize(
    ("args", "field", "value", "code"),
    [
        (["--endpoint", "tcp://127.0.0.1:99999"], "server.endpoint", "99999", FIELD_EXIT),
        (["--endpoint", "tcp://127.0.0.1"], "server.endpoint", "tcp://127.0.0.1", FIELD_EXIT),
        (["--endpoint", "bogus://x"], "server.endpoint", "bogus://x", FIELD_EXIT),
        (["--endpoint", "ipc://"], "server.endpoint", "ipc://", FIELD_EXIT),
        (["--l1-size", "1Pi"], "l1.size_bytes", str(1 << 50), START_EXIT),
    ],
)
def test_a_bad_setting_exits_naming_the_field_and_its_value(
    sidecar_factory: Any, kit: Any, args: list[str], field: str, value: str, code: int
):
    result = _run(kit, sidecar_factory(), args)
    assert result.returncode == code, result.stderr
    assert field in result.stderr and value in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_an_ipc_path_that_cannot_be_bound_exits_naming_server_endpoint(
    sidecar_factory: Any, kit: Any, tmp_path: Path
):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    endpoint = f"ipc://{blocker}/sidecar.sock"
    result = _run(kit, sidecar_factory(), ["--endpoint", endpoint])
    assert result.returncode == START_EXIT, result.stderr
    assert "server.endpoint" in result.stderr and endpoint in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_an_http_port_in_use_exits_naming_server_http_port(sidecar_factory: Any, kit: Any):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        result = _run(kit, sidecar_factory(), ["--http-port", str(port)])
    assert result.returncode == START_EXIT, result.stderr
    assert "server.http_port" in result.stderr and str(port) in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
