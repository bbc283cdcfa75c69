"""From a ``KVCache`` spec to the sidecar's config, through the sidecar's own schema.

Why this module exists: the ConfigMap the operator writes must load in the
sidecar's loader, always. So the spec is translated into a plain dict of
:class:`kvstrata.sidecar.config.SidecarConfig` fields, validated by
``config_from_dict`` and written with ``dump_config``: a spec the loader would
refuse is refused here, with the loader's message naming the field.

It also fixes the in-pod layout every other operator module uses (paths,
names, annotations), so the webhook mounts exactly what the config points at.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvstrata import __version__
from kvstrata.sidecar.config import ConfigError, SidecarConfig, config_from_dict, dump_config

GROUP = "kvstrata.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "KVCache"
PLURAL = "kvcaches"

# Pod annotations and labels.
CACHE_ANNOTATION = "kvstrata.io/cache"  # asks for a sidecar: the KVCache name
VLLM_CONTAINER_ANNOTATION = "kvstrata.io/vllm-container"  # names the vLLM container
INJECT_PACKAGE_ANNOTATION = "kvstrata.io/inject-package"  # "false": image ships kvstrata
SKIPPED_ANNOTATION = "kvstrata.io/injection-skipped"  # why a pod was left as it was
INJECTED_ANNOTATION = "kvstrata.io/injected"  # config hash the pod was injected with
CONFIG_HASH_ANNOTATION = "kvstrata.io/config-hash"  # on workload pod templates: rolls them
CACHE_LABEL = "kvstrata.io/cache"  # on injected pods: counted into status.injectedPods

# In-pod layout.
SOCKET_DIR = "/var/run/kvstrata"
ENDPOINT = f"ipc://{SOCKET_DIR}/sidecar.sock"
CONFIG_DIR = "/etc/kvstrata"
CONFIG_FILE = "sidecar.yaml"
CONFIG_PATH = f"{CONFIG_DIR}/{CONFIG_FILE}"
SECRETS_DIR = "/etc/kvstrata-secrets"
VALKEY_PASSWORD_FILE = f"{SECRETS_DIR}/valkey/password"
VALKEY_CA_FILE = f"{SECRETS_DIR}/valkey-tls/ca.crt"
S3_ACCESS_KEY_FILE = f"{SECRETS_DIR}/s3/access-key-id"
S3_SECRET_KEY_FILE = f"{SECRETS_DIR}/s3/secret-access-key"
L2_DIR = "/var/cache/kvstrata/l2"
PYTHON_DIR = "/opt/kvstrata/python"

DEFAULT_METRICS_PORT = 9464
VALKEY_PORT = 6379


IMAGE_REGISTRY = "ghcr.io/kvstrata"
PULL_POLICIES = ("Always", "IfNotPresent", "Never")


@dataclass(frozen=True, slots=True)
class Image:
    """An image reference (``repo:tag``, ``repo@sha256:...`` or both) and its pull policy."""

    ref: str
    pull_policy: str = "IfNotPresent"


@dataclass(frozen=True, slots=True)
class Images:
    """The images the operator puts into pods when a KVCache names none.

    ``sidecar`` runs the sidecar in host transfer mode, ``sidecar_cuda`` where
    the sidecar sees a GPU, ``installer`` copies the connector into vLLM pods,
    ``valkey`` runs a managed shared tier. The defaults are the images
    ``make images`` builds for this version; the chart sets each one through
    ``KVSTRATA_OPERATOR_<NAME>_IMAGE`` and ``KVSTRATA_OPERATOR_<NAME>_PULL_POLICY``
    (NAME: ``SIDECAR``, ``SIDECAR_CUDA``, ``INSTALLER``, ``VALKEY``).
    """

    sidecar: Image = Image(f"{IMAGE_REGISTRY}/kvstrata-sidecar:{__version__}")
    sidecar_cuda: Image = Image(f"{IMAGE_REGISTRY}/kvstrata-sidecar-cuda:{__version__}")
    installer: Image = Image(f"{IMAGE_REGISTRY}/kvstrata-sidecar:{__version__}")
    valkey: Image = Image("docker.io/valkey/valkey:8.0.2")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Images:
        """The defaults, each replaced by the environment where it is set and not empty.

        Raises :class:`ValueError` naming the variable for an unknown pull policy.
        """
        env = os.environ if environ is None else environ
        images = {}
        for field, spec in cls.__dataclass_fields__.items():
            default: Image = spec.default
            prefix = f"KVSTRATA_OPERATOR_{field.upper()}"
            policy = env.get(f"{prefix}_PULL_POLICY") or default.pull_policy
            if policy not in PULL_POLICIES:
                raise ValueError(f"{prefix}_PULL_POLICY={policy!r}: one of {PULL_POLICIES}")
            images[field] = Image(env.get(f"{prefix}_IMAGE") or default.ref, policy)
        return cls(**images)


class SpecError(ValueError):
    """A KVCache spec that cannot be rendered; the message names the field."""


def configmap_name(name: str) -> str:
    return f"{name}-sidecar"


def valkey_name(name: str) -> str:
    return f"{name}-valkey"


def valkey_auth_secret_name(name: str) -> str:
    return f"{name}-valkey-auth"


def shared_tier_kind(spec: Mapping[str, Any]) -> str:
    """``none`` | ``valkey-managed`` | ``valkey-external`` | ``s3`` (status.sharedTier)."""
    shared = spec.get("shared") or {}
    backend = shared.get("backend", "none")
    if backend == "valkey":
        return (
            "valkey-external" if (shared.get("valkey") or {}).get("external") else "valkey-managed"
        )
    return str(backend)


def valkey_url(spec: Mapping[str, Any], name: str, namespace: str) -> str:
    """The URL the sidecars use: the managed client Service, or the external URL."""
    valkey = (spec.get("shared") or {}).get("valkey") or {}
    external = valkey.get("external")
    if external is not None:
        url = external.get("url")
        if not url:
            raise SpecError("spec.shared.valkey.external.url: required for an external Valkey")
        return str(url)
    return f"redis://{valkey_name(name)}.{namespace}.svc:{VALKEY_PORT}/0"


def _valkey_section(spec: Mapping[str, Any], name: str, namespace: str) -> dict[str, Any]:
    valkey = (spec.get("shared") or {}).get("valkey") or {}
    external = valkey.get("external")
    out: dict[str, Any] = {"url": valkey_url(spec, name, namespace)}
    if external is not None:
        out["cluster"] = bool(external.get("cluster", False))
        if external.get("username"):
            out["username"] = external["username"]
        if external.get("passwordSecretRef"):
            out["password_file"] = VALKEY_PASSWORD_FILE
        tls = external.get("tls") or {}
        if tls.get("caSecretRef"):
            out["tls_ca_file"] = VALKEY_CA_FILE
        out["tls_insecure_skip_verify"] = bool(tls.get("insecureSkipVerify", False))
    elif ((valkey.get("managed") or {}).get("auth") or {}).get("enabled", True):
        out["password_file"] = VALKEY_PASSWORD_FILE
    if valkey.get("ttlSeconds") is not None:
        out["ttl_seconds"] = valkey["ttlSeconds"]
    # Each KVCache its own key space: two caches on one Valkey with one prefix
    # would read each other's chunks. An ACL user limited to ~<prefix>* makes
    # that a server-side rule (see the README's Security section).
    out["key_prefix"] = valkey.get("keyPrefix") or default_key_prefix(name, namespace)
    return out


def default_key_prefix(name: str, namespace: str) -> str:
    """The Valkey key prefix of a KVCache that names none: unique per KVCache."""
    return f"kvstrata:{namespace}/{name}:"


def _s3_section(spec: Mapping[str, Any]) -> dict[str, Any]:
    s3 = (spec.get("shared") or {}).get("s3") or {}
    if not s3.get("bucket"):
        raise SpecError("spec.shared.s3.bucket: required when spec.shared.backend is s3")
    out: dict[str, Any] = {
        "endpoint_url": s3.get("endpoint") or None,
        "region": s3.get("region", "us-east-1"),
        "bucket": s3["bucket"],
        "prefix": s3.get("prefix", "kvstrata/"),
        # The operator creates the bucket (spec.shared.s3.createBucket); the
        # sidecars then need no CreateBucket permission.
        "create_bucket": False,
    }
    if s3.get("credentialsSecretRef"):
        out["access_key_id_file"] = S3_ACCESS_KEY_FILE
        out["secret_access_key_file"] = S3_SECRET_KEY_FILE
    return out


def sidecar_config_dict(spec: Mapping[str, Any], name: str, namespace: str) -> dict[str, Any]:
    """Translate a KVCache spec into SidecarConfig fields (not yet validated)."""
    l1 = spec.get("l1") or {}
    l2 = spec.get("l2") or {}
    shared = spec.get("shared") or {}
    metrics = spec.get("metrics") or {}
    backend = shared.get("backend", "none")
    out: dict[str, Any] = {
        "chunk_size": spec.get("chunkSize", 256),
        "transfer_mode": spec.get("transferMode", "auto"),
        "log_level": spec.get("logLevel", "INFO"),
        "l1": {"size_bytes": l1.get("size", "1Gi"), "policy": l1.get("policy", "lru")},
        "l2": {
            "enabled": bool(l2.get("enabled", True)),
            "path": L2_DIR,
            "size_bytes": l2.get("size", "4Gi"),
        },
        "shared": {
            "backend": backend,
            "codec": shared.get("codec", "none"),
            "admission": shared.get("admission", "all"),
        },
        "server": {
            "endpoint": ENDPOINT,
            "http_port": metrics.get("port", DEFAULT_METRICS_PORT),
        },
    }
    if backend == "valkey":
        out["shared"]["valkey"] = _valkey_section(spec, name, namespace)
    elif backend == "s3":
        out["shared"]["s3"] = _s3_section(spec)
    return out


def render_sidecar_config(kvcache: Mapping[str, Any]) -> tuple[SidecarConfig, str]:
    """The validated config and the ``sidecar.yaml`` text for one KVCache.

    Raises :class:`SpecError` (a ``ValueError``) carrying the loader's
    field-naming message when the sidecar would refuse the result.
    """
    meta = kvcache.get("metadata") or {}
    name, namespace = meta.get("name", ""), meta.get("namespace", "default")
    data = sidecar_config_dict(kvcache.get("spec") or {}, name, namespace)
    try:
        config = config_from_dict(data, source=f"KVCache {namespace}/{name}")
    except ConfigError as exc:
        raise SpecError(str(exc)) from None
    return config, dump_config(config)


def config_hash(kvcache: Mapping[str, Any], config_text: str) -> str:
    """A short digest of everything that shapes an injected pod.

    Covers the rendered config and the spec (sidecar image, resources, volumes),
    so any change that needs new pods changes the hash and rolls the workloads.
    """
    digest = hashlib.sha256(config_text.encode())
    digest.update(json.dumps(kvcache.get("spec") or {}, sort_keys=True).encode())
    return digest.hexdigest()[:16]
