"""kopf logs in with whatever the kubeconfig (or the pod's service account) holds.

Each credential kind is written as a real kubeconfig file (certificates made
with ``cryptography``, an exec plugin as a small script that prints an
ExecCredential), run through kopf's own login machinery with the operator's
registry, and then used: kopf asks ``/version`` of a loopback HTTPS server
that, like an API server, answers only a verified client certificate or the
expected bearer token and says 401 to anything else.
"""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import json
import logging
import os
import ssl
import stat
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import kopf
import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from kopf._cogs.clients import auth, scanning
from kopf._cogs.structs import credentials
from kopf._core.engines import activities, indexing

from kvstrata.operator import handlers, kube
from kvstrata.testing.poll import wait_until

REPO = Path(__file__).resolve().parents[2]
USER = "kvstrata-operator"  # the client certificate's CommonName
TOKEN = "kvstrata-test-token"
VERSION = {"major": "1", "minor": "28", "gitVersion": "v1.28.15"}


# -- certificates ------------------------------------------------------------------


@dataclass(frozen=True)
class PKI:
    ca_pem: bytes
    server_pem: bytes
    server_key: bytes
    client_pem: bytes
    client_key: bytes


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.TraditionalOpenSSL,  # "EC PRIVATE KEY", as kubeadm writes
        serialization.NoEncryption(),
    )


def _certificate(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: tuple[x509.Name, ec.EllipticCurvePrivateKey] | None,
    usage: x509.ObjectIdentifier | None,
    ip: str | None = None,
) -> x509.Certificate:
    import ipaddress

    now = dt.datetime.now(dt.timezone.utc)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    issuer_name, signer = issuer or (name, key)
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), critical=True)
    )
    if usage is not None:
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if ip is not None:
        san = x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(ip))])
        builder = builder.add_extension(san, critical=False)
    return builder.sign(signer, hashes.SHA256())


@pytest.fixture(scope="module")
def pki() -> PKI:
    """A cluster CA, a serving certificate for 127.0.0.1, a client certificate for USER."""
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _certificate("kvstrata-test-ca", ca_key, None, None)
    server_key = ec.generate_private_key(ec.SECP256R1())
    server = _certificate(
        "127.0.0.1", server_key, (ca.subject, ca_key), ExtendedKeyUsageOID.SERVER_AUTH, "127.0.0.1"
    )
    client_key = ec.generate_private_key(ec.SECP256R1())
    client = _certificate(USER, client_key, (ca.subject, ca_key), ExtendedKeyUsageOID.CLIENT_AUTH)
    pem = serialization.Encoding.PEM
    return PKI(
        ca.public_bytes(pem),
        server.public_bytes(pem),
        _pem_key(server_key),
        client.public_bytes(pem),
        _pem_key(client_key),
    )


# -- a loopback HTTPS server that authenticates like an API server -------------------


class AuthenticatingServer(ThreadingHTTPServer):
    """Answers a verified client certificate (CN = USER) or ``Bearer TOKEN``; else 401."""

    def __init__(self, pki: PKI, workdir: Path) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        for name, data in (("ca.crt", pki.ca_pem), ("tls.crt", pki.server_pem)):
            (workdir / name).write_bytes(data)
        (workdir / "tls.key").write_bytes(pki.server_key)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(workdir / "tls.crt", workdir / "tls.key")
        context.load_verify_locations(workdir / "ca.crt")
        context.verify_mode = ssl.CERT_OPTIONAL  # a token client sends no certificate
        self.socket = context.wrap_socket(self.socket, server_side=True)
        self.seen: list[dict[str, str | None]] = []

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    server: AuthenticatingServer

    def do_GET(self) -> None:
        identity = self._identity()
        self.server.seen.append(
            {"path": self.path, "identity": identity, "agent": self.headers.get("User-Agent")}
        )
        if identity is None:
            self._send(401, {"kind": "Status", "code": 401, "reason": "Unauthorized"})
        elif self.path == "/version":
            self._send(200, VERSION)
        elif self.path == "/api":
            self._send(200, {"kind": "APIVersions", "versions": ["v1"]})
        elif self.path == "/apis":
            self._send(200, {"kind": "APIGroupList", "apiVersion": "v1", "groups": []})
        elif self.path == "/api/v1":
            self._send(200, {"kind": "APIResourceList", "groupVersion": "v1", "resources": []})
        else:
            self._send(404, {"kind": "Status", "code": 404, "reason": "NotFound"})

    def _identity(self) -> str | None:
        peer = self.connection.getpeercert()  # only ever a certificate the CA verified
        if peer:
            fields = dict(entry[0] for entry in peer["subject"])
            return f"certificate:{fields.get('commonName')}"
        if self.headers.get("Authorization") == f"Bearer {TOKEN}":
            return "token"
        return None

    def _send(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def api_server(pki: PKI, tmp_path: Path) -> Iterator[AuthenticatingServer]:
    workdir = tmp_path / "server"
    workdir.mkdir()
    server = AuthenticatingServer(pki, workdir)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


# -- kubeconfig files, one per credential kind ---------------------------------------


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _exec_plugin(path: Path, status: dict[str, str]) -> Path:
    """A credential plugin: a script printing an ExecCredential, as kubectl plugins do."""
    credential = {
        "apiVersion": "client.authentication.k8s.io/v1",
        "kind": "ExecCredential",
        "status": status,
    }
    path.write_text(f"#!{sys.executable}\nimport json\nprint(json.dumps({credential!r}))\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def write_kubeconfig(kind: str, server: str, pki: PKI, directory: Path) -> Path:
    """A kubeconfig whose user authenticates by ``kind``."""
    cluster: dict[str, Any] = {"server": server, "certificate-authority-data": _b64(pki.ca_pem)}
    if kind == "client-certificate-data":  # what kind and kubeadm write
        user = {
            "client-certificate-data": _b64(pki.client_pem),
            "client-key-data": _b64(pki.client_key),
        }
    elif kind == "client-certificate-files":
        (directory / "ca.crt").write_bytes(pki.ca_pem)
        (directory / "client.crt").write_bytes(pki.client_pem)
        (directory / "client.key").write_bytes(pki.client_key)
        cluster = {"server": server, "certificate-authority": str(directory / "ca.crt")}
        user = {"client-certificate": "client.crt", "client-key": "client.key"}  # relative
    elif kind == "token":
        user = {"token": TOKEN}
    elif kind == "token-file":
        (directory / "token").write_text(TOKEN + "\n")
        user = {"tokenFile": str(directory / "token")}
    elif kind == "exec-token":
        plugin = _exec_plugin(directory / "token-plugin", {"token": TOKEN})
        user = {"exec": _exec_config(plugin)}
    elif kind == "exec-client-certificate":
        plugin = _exec_plugin(
            directory / "cert-plugin",
            {
                "clientCertificateData": pki.client_pem.decode(),
                "clientKeyData": pki.client_key.decode(),
            },
        )
        user = {"exec": _exec_config(plugin)}
    else:
        raise ValueError(kind)
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "test", "cluster": cluster}],
        "users": [{"name": "test", "user": user}],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test"}}],
        "current-context": "test",
    }
    path = directory / "kubeconfig"
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path


def _exec_config(plugin: Path) -> dict[str, Any]:
    return {
        "apiVersion": "client.authentication.k8s.io/v1",
        "command": str(plugin),
        "interactiveMode": "Never",
    }


CREDENTIALS = {
    "client-certificate-data": f"certificate:{USER}",
    "client-certificate-files": f"certificate:{USER}",
    "token": "token",
    "token-file": "token",
    "exec-token": "token",
    "exec-client-certificate": f"certificate:{USER}",
}


# -- kopf's login machinery, as the operator runs it ---------------------------------


async def _kopf_reads_version() -> dict[str, str]:
    """Authenticate through the operator's registry, then GET /version through kopf's client."""
    registry = kopf.OperatorRegistry()
    handlers.register(registry, webhook=False)
    settings = kopf.OperatorSettings()
    vault = credentials.Vault()
    # kopf's re-authenticating loop, as the operator runs it: a 401 empties the
    # vault, the loop calls the login handlers again.
    authenticator = asyncio.create_task(
        activities.authenticator(
            registry=registry,
            settings=settings,
            indices=indexing.OperatorIndexers().indices,
            vault=vault,
            memo=kopf.Memo(),
        )
    )
    token = auth.vault_var.set(vault)
    try:
        reading = scanning.read_version(settings=settings, logger=logging.getLogger(__name__))
        return await asyncio.wait_for(reading, timeout=30)
    finally:
        auth.vault_var.reset(token)
        authenticator.cancel()
        await asyncio.gather(authenticator, return_exceptions=True)
        await vault.close()


def kopf_reads_version() -> dict[str, str]:
    return asyncio.run(_kopf_reads_version())


@pytest.fixture
def no_cluster_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No kubeconfig and no service account unless a test provides one."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_PORT", raising=False)
    monkeypatch.setattr(kube, "SERVICE_ACCOUNT_DIR", tmp_path / "no-service-account")
    return home


@pytest.mark.parametrize("kind", sorted(CREDENTIALS))
def test_kopf_logs_in_with_each_kind_of_kubeconfig_credential_and_uses_it(
    kind, pki, api_server, tmp_path, monkeypatch, no_cluster_env
):
    config_dir = tmp_path / "kube"
    config_dir.mkdir()
    monkeypatch.setenv("KUBECONFIG", str(write_kubeconfig(kind, api_server.url, pki, config_dir)))
    assert kopf_reads_version() == VERSION
    assert api_server.seen[-1]["path"] == "/version"
    assert api_server.seen[-1]["identity"] == CREDENTIALS[kind]
    assert str(api_server.seen[-1]["agent"]).startswith("kopf/")


@pytest.mark.parametrize("kind", sorted(CREDENTIALS))
def test_the_operators_own_cluster_client_uses_the_same_credentials(
    kind, pki, api_server, tmp_path, monkeypatch, no_cluster_env
):
    config_dir = tmp_path / "kube"
    config_dir.mkdir()
    monkeypatch.setenv("KUBECONFIG", str(write_kubeconfig(kind, api_server.url, pki, config_dir)))
    assert kube.KubeCluster().has_kind("v1", "Pod") is False  # the test server serves none
    assert api_server.seen[-1]["path"] == "/api/v1"
    assert api_server.seen[-1]["identity"] == CREDENTIALS[kind]


def test_kopf_logs_in_with_the_pods_service_account(
    pki, api_server, tmp_path, monkeypatch, no_cluster_env
):
    account = tmp_path / "serviceaccount"
    account.mkdir()
    (account / "token").write_text(TOKEN)
    (account / "ca.crt").write_bytes(pki.ca_pem)
    (account / "namespace").write_text("kvstrata-system")
    monkeypatch.setattr(kube, "SERVICE_ACCOUNT_DIR", account)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(api_server.server_address[1]))
    assert kube.in_cluster() and kube.cluster_configured()
    assert kopf_reads_version() == VERSION
    assert api_server.seen[-1]["identity"] == "token"


def test_a_kubeconfig_in_the_home_directory_is_found_without_kubeconfig_set(
    pki, api_server, no_cluster_env
):
    kube_dir = no_cluster_env / ".kube"
    kube_dir.mkdir()
    written = write_kubeconfig("client-certificate-data", api_server.url, pki, kube_dir)
    written.rename(kube_dir / "config")
    assert kube.cluster_configured()
    assert kopf_reads_version() == VERSION


def test_a_rejected_token_ends_in_kopfs_login_error_not_a_silent_retry(
    pki, api_server, tmp_path, monkeypatch, no_cluster_env
):
    config_dir = tmp_path / "kube"
    config_dir.mkdir()
    path = write_kubeconfig("token", api_server.url, pki, config_dir)
    path.write_text(path.read_text().replace(TOKEN, "not-the-token"))
    monkeypatch.setenv("KUBECONFIG", str(path))
    with pytest.raises(credentials.LoginError, match="Ran out of valid credentials"):
        kopf_reads_version()
    assert api_server.seen and {seen["identity"] for seen in api_server.seen} == {None}


def test_without_any_configuration_nothing_counts_as_a_configured_cluster(no_cluster_env):
    assert not kube.cluster_configured()
    from kubernetes.config import ConfigException

    with pytest.raises(ConfigException, match="no kubeconfig"):
        kube.client_configuration()


def wait_for(condition: Callable[[], Any], timeout: float, what: str) -> Any:
    return wait_until(condition, timeout, what, step=0.2, error=pytest.fail.Exception)


@pytest.mark.slow
def test_the_operator_command_authenticates_with_a_client_certificate_kubeconfig(
    pki, api_server, tmp_path
):
    config_dir = tmp_path / "kube"
    config_dir.mkdir()
    kubeconfig = write_kubeconfig("client-certificate-data", api_server.url, pki, config_dir)
    env = {
        **os.environ,
        "KUBECONFIG": str(kubeconfig),
        "HOME": str(tmp_path),
        "KUBERNETES_SERVICE_HOST": "",
    }
    log = tmp_path / "operator.log"
    args = [sys.executable, "-m", "kvstrata.cli", "operator", "--watch-namespace", "ml"]
    args += ["--namespace", "ml", "--webhook-port", "0", "--liveness", ""]
    with log.open("wb") as out:
        process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    try:
        wait_for(
            lambda: any(
                s["identity"] == f"certificate:{USER}" and str(s["agent"]).startswith("kopf/")
                for s in api_server.seen
            ),
            60,
            "the operator's kopf to call the API server with its client certificate",
        )
        text = wait_for(
            lambda: "Initial authentication has finished" in log.read_text() and log.read_text(),
            30,
            "kopf to report its login",
        )
    finally:
        process.terminate()
        process.wait(timeout=30)
    assert "no credentials were retrieved" not in text
    assert "LoginError" not in text
