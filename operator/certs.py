"""The admission webhook's serving certificate: generate, keep, rotate.

Why: the API server only calls webhooks over TLS it trusts. Unless the chart
hands this job to cert-manager, the operator makes a self-signed CA and a
serving certificate for the webhook Service's DNS names, keeps both in a
Secret, and patches the CA into the MutatingWebhookConfiguration's
``caBundle``.

Persisted state, Secret ``<release>-webhook-tls`` (type ``Opaque``: it carries the CA and
its key beside the serving pair, and a Secret's type cannot change once created)::

    data:
      ca.crt:  PEM CA certificate (10 years; kept while valid so caBundle stays put)
      ca.key:  PEM CA private key (EC P-256)
      tls.crt: PEM serving certificate (1 year), signed by the CA, SANs = the Service names
      tls.key: PEM serving key (EC P-256)

Rotation: :func:`needs_rotation` says when the serving certificate expires
within 30 days, names other DNS names, or was not signed by the stored CA;
then a new one is issued by the same CA (a new CA only when the CA itself
is within 30 days of expiry or unreadable).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec

ROTATE_BEFORE = dt.timedelta(days=30)
CA_LIFETIME = dt.timedelta(days=3650)
SERVING_LIFETIME = dt.timedelta(days=365)


@dataclass(frozen=True, slots=True)
class TLSBundle:
    ca_crt: bytes
    ca_key: bytes
    tls_crt: bytes
    tls_key: bytes

    def as_secret_data(self) -> dict[str, bytes]:
        return {
            "ca.crt": self.ca_crt,
            "ca.key": self.ca_key,
            "tls.crt": self.tls_crt,
            "tls.key": self.tls_key,
        }

    @classmethod
    def from_secret_data(cls, data: Mapping[str, bytes]) -> TLSBundle | None:
        try:
            return cls(data["ca.crt"], data["ca.key"], data["tls.crt"], data["tls.key"])
        except KeyError:
            return None


def service_dns_names(service: str, namespace: str) -> list[str]:
    return [
        service,
        f"{service}.{namespace}",
        f"{service}.{namespace}.svc",
        f"{service}.{namespace}.svc.cluster.local",
    ]


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _new_ca(now: dt.datetime) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvstrata webhook CA")])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + CA_LIFETIME)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    return cert, key


def _general_name(name: str) -> x509.GeneralName:
    """A SAN entry: an IP address when ``name`` is one, else a DNS name."""
    import ipaddress

    from cryptography import x509

    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def _san_names(cert: x509.Certificate) -> list[str]:
    from cryptography import x509

    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    ips = [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)]
    return sans.get_values_for_type(x509.DNSName) + ips


def issue(dns_names: Sequence[str], ca: TLSBundle | None = None) -> TLSBundle:
    """A serving certificate for ``dns_names`` (IP addresses allowed), signed by ``ca``'s CA.

    A new CA is made when ``ca`` is None or its CA is close to expiry.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = _now()
    if ca is not None and not _ca_expiring(ca, now):
        ca_cert = x509.load_pem_x509_certificate(ca.ca_crt)
        ca_key = serialization.load_pem_private_key(ca.ca_key, password=None)
    else:
        ca_cert, ca_key = _new_ca(now)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, dns_names[0])]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + SERVING_LIFETIME)
        .add_extension(x509.SubjectAlternativeName([_general_name(n) for n in dns_names]), False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    return TLSBundle(
        ca_crt=ca_cert.public_bytes(pem),
        ca_key=_pem_key(ca_key),
        tls_crt=cert.public_bytes(pem),
        tls_key=_pem_key(key),
    )


def _ca_expiring(bundle: TLSBundle, now: dt.datetime) -> bool:
    from cryptography import x509

    try:
        ca = x509.load_pem_x509_certificate(bundle.ca_crt)
    except ValueError:
        return True
    return ca.not_valid_after_utc - now < ROTATE_BEFORE


def needs_rotation(bundle: TLSBundle | None, dns_names: Sequence[str]) -> str | None:
    """Why the stored bundle must be replaced, or None when it is good."""
    from cryptography import x509
    from cryptography.exceptions import InvalidSignature

    if bundle is None:
        return "no certificate stored"
    now = _now()
    try:
        cert = x509.load_pem_x509_certificate(bundle.tls_crt)
        ca = x509.load_pem_x509_certificate(bundle.ca_crt)
    except ValueError:
        return "stored certificate is not readable PEM"
    if _ca_expiring(bundle, now):
        return "CA expires within 30 days"
    if cert.not_valid_after_utc - now < ROTATE_BEFORE:
        return "serving certificate expires within 30 days"
    try:
        cert.verify_directly_issued_by(ca)  # checks the signature, not just the names
    except (ValueError, TypeError, InvalidSignature):
        return "serving certificate was not issued by the stored CA"
    if sorted(_san_names(cert)) != sorted(dns_names):
        return "serving certificate names other hosts"
    return None
