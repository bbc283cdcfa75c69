"""The Valkey tier over TLS (``rediss://``) against a real TLS listener.

The server gets a certificate for 127.0.0.1 signed by a CA made here; the
tier must verify it with ``tls_ca_file``, refuse it without, and accept it
with ``tls_insecure_skip_verify``.
"""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from kvstrata.sidecar.keys import Namespace, make_key
from kvstrata.sidecar.objformat import ChunkMeta
from kvstrata.sidecar.tiers.factory import build_shared_tier
from kvstrata.testing.servers import RedisServer, free_port

KEY = make_key(Namespace(model="tls").fingerprint(), b"\x07" * 32)
META = ChunkMeta(dtype="uint8", shape=(5,))


def _cert(subject: str, issuer_key, public_key, issuer: str, ca: bool, ip: str | None = None):
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ip is not None:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(ip))]),
            critical=False,
        )
    return builder.sign(issuer_key, hashes.SHA256())


def _pem_key(key) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _write_pki(base: Path) -> dict[str, Path]:
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _cert("kvstrata test CA", ca_key, ca_key.public_key(), "kvstrata test CA", ca=True)
    server_key = ec.generate_private_key(ec.SECP256R1())
    server = _cert(
        "127.0.0.1", ca_key, server_key.public_key(), "kvstrata test CA", False, "127.0.0.1"
    )
    paths = {"ca": base / "ca.pem", "cert": base / "server.pem", "key": base / "server.key"}
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths["cert"].write_bytes(server.public_bytes(serialization.Encoding.PEM))
    paths["key"].write_bytes(_pem_key(server_key))
    return paths


@pytest.fixture
def tls_server(tmp_path: Path):
    pki = _write_pki(tmp_path)
    tls_port = free_port()
    extra = (
        "--tls-port", str(tls_port),
        "--tls-cert-file", str(pki["cert"]),
        "--tls-key-file", str(pki["key"]),
        "--tls-ca-cert-file", str(pki["ca"]),
        "--tls-auth-clients", "no",
    )  # fmt: skip
    with RedisServer(tmp_path / "data", extra_args=extra):
        yield f"rediss://127.0.0.1:{tls_port}/0", pki["ca"]


def test_tls_with_the_right_ca_stores_and_reads(tls_server, valkey_config) -> None:
    url, ca = tls_server
    tier = build_shared_tier(valkey_config(url, valkey={"tls_ca_file": str(ca)}))
    assert tier.put(KEY, b"hello", META)
    got = tier.get(KEY)
    assert got is not None and bytes(got.payload) == b"hello"
    tier.close()


def test_tls_without_the_ca_is_refused_as_misses_not_errors_raised(
    tls_server, valkey_config
) -> None:
    url, _ = tls_server
    tier = build_shared_tier(valkey_config(url, breaker_failures=100))
    assert tier.put(KEY, b"hello", META) is False
    assert tier.get(KEY) is None
    assert sum(tier.stats().errors_total.values()) >= 2
    tier.close()


def test_tls_insecure_skip_verify_accepts_an_unknown_ca(tls_server, valkey_config) -> None:
    url, _ = tls_server
    tier = build_shared_tier(valkey_config(url, valkey={"tls_insecure_skip_verify": True}))
    assert tier.put(KEY, b"hello", META)
    assert tier.get(KEY) is not None
    tier.close()
