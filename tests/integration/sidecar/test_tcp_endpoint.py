"""A tcp:// endpoint is served only on loopback, or to clients that hold a
key the sidecar lists (ZeroMQ CURVE)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import zmq.auth

from kvstrata.connector.client import CurveKeys, SidecarClient


def test_a_tcp_endpoint_off_loopback_without_curve_keys_is_refused_naming_the_field(
    sidecar_factory: Any, kit: Any
):
    sidecar = sidecar_factory()
    endpoint = f"tcp://0.0.0.0:{kit.free_port()}"
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("KVSTRATA_")}
    result = subprocess.run(
        [*kit.SIDECAR_COMMAND, "--config", str(sidecar.config_path), "--endpoint", endpoint],
        capture_output=True,
        text=True,
        timeout=30,
        env=inherited,
    )
    assert result.returncode == 2, result.stderr
    assert "server.endpoint" in result.stderr and endpoint in result.stderr
    assert "server.curve_secret_key_file" in result.stderr


def test_with_curve_keys_only_a_listed_client_is_served(
    sidecar_factory: Any, kit: Any, tmp_path: Path
):
    keys, allowed = tmp_path / "keys", tmp_path / "allowed"
    keys.mkdir()
    allowed.mkdir()
    server_public, server_secret = zmq.auth.create_certificates(str(keys), "server")
    zmq.auth.create_certificates(str(keys), "listed")
    _, stranger_secret = zmq.auth.create_certificates(str(keys), "stranger")
    (allowed / "listed.key").write_bytes((keys / "listed.key").read_bytes())
    port = kit.free_port()
    sidecar = sidecar_factory(
        overrides={
            "server": {
                "endpoint": f"tcp://0.0.0.0:{port}",
                "curve_secret_key_file": server_secret,
                "curve_client_keys_dir": str(allowed),
            }
        }
    ).start()
    endpoint = f"tcp://127.0.0.1:{port}"

    def client(curve: CurveKeys | None) -> SidecarClient:
        return SidecarClient(endpoint, kit.NAMESPACE, role="worker", call_timeout_s=1, curve=curve)

    listed = client(CurveKeys.load(server_public, str(keys / "listed.key_secret")))
    stranger = client(CurveKeys.load(server_public, stranger_secret))
    plain = client(None)
    try:
        assert listed.ping(), listed.errors
        keys_ = kit.make_keys(2, seed=500)
        assert kit.store(listed, keys_, 4096, owner="w") == 2
        assert not stranger.ping()
        assert not plain.ping()
        assert sidecar.status()["clients_connected"] == 1
    finally:
        for c in (listed, stranger, plain):
            c.close()
