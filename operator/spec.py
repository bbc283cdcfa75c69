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
from kvstrata.operator import names
from kvstrata.operator.model import (
    ACCESS_KEY_ID_KEY,
    CA_KEY,
    PASSWORD_KEY,
    SECRET_ACCESS_KEY_KEY,
    KVCache,
    KVCacheLike,
    KVCacheSpec,
    SpecError,
    TenantSpec,
)
from kvstrata.operator.model import DEFAULT_METRICS_PORT as DEFAULT_METRICS_PORT
from kvstrata.sidecar.config import (
    ConfigError,
    SidecarConfig,
    config_from_dict,
    dump_config,
    parse_quantity,
)

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
REROLL_ANNOTATION = "kvstrata.io/reroll"  # on pod templates: rolled again, see rollout.py
CACHE_LABEL = "kvstrata.io/cache"  # on injected pods: counted into status.injectedPods
# The sidecar's HTTP port (/metrics, /readyz, /healthz) as the metrics Service
# targets it. A port name is an IANA_SVC_NAME: at most 15 characters
# (apimachinery validation.IsValidPortName), or the API server refuses the pod.
METRICS_PORT_NAME = "metrics"

# In-pod layout.
SOCKET_DIR = "/var/run/kvstrata"
ENDPOINT = f"ipc://{SOCKET_DIR}/sidecar.sock"
CONFIG_DIR = "/etc/kvstrata"
CONFIG_FILE = "sidecar.yaml"
CONFIG_PATH = f"{CONFIG_DIR}/{CONFIG_FILE}"
SECRETS_DIR = "/etc/kvstrata-secrets"
# Each Secret is mounted in its own directory, its key projected to a file of
# the same name as the key's default (whatever key the KVCache names).
VALKEY_SECRET_DIR = f"{SECRETS_DIR}/valkey"
VALKEY_TLS_SECRET_DIR = f"{SECRETS_DIR}/valkey-tls"
S3_SECRET_DIR = f"{SECRETS_DIR}/s3"
# The whole keys Secret (no items: keys added by a rotation appear in place).
ENCRYPTION_KEY_DIR = f"{SECRETS_DIR}/keys"
VALKEY_PASSWORD_FILE = f"{VALKEY_SECRET_DIR}/{PASSWORD_KEY}"
VALKEY_CA_FILE = f"{VALKEY_TLS_SECRET_DIR}/{CA_KEY}"
S3_ACCESS_KEY_FILE = f"{S3_SECRET_DIR}/{ACCESS_KEY_ID_KEY}"
S3_SECRET_KEY_FILE = f"{S3_SECRET_DIR}/{SECRET_ACCESS_KEY_KEY}"
L2_DIR = "/var/cache/kvstrata/l2"
PYTHON_DIR = "/opt/kvstrata/python"

# The managed Valkey's users: the sidecars' (keys under the cache's prefix
# only) and the replicas' (replication commands only); "default" is off.
MANAGED_VALKEY_USER = "kvstrata"
MANAGED_VALKEY_REPLICA_USER = "replica"
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


# Names of what a KVCache owns (legal whatever the KVCache's name: see names.py).
def configmap_name(name: str) -> str:
    return names.child_name(name, "sidecar")


def valkey_name(name: str) -> str:
    """The managed Valkey's StatefulSet and client Service (52 at most: a StatefulSet's)."""
    return names.child_name(name, "valkey", names.STATEFULSET_NAME_MAX)


def valkey_headless_name(name: str) -> str:
    return f"{valkey_name(name)}-headless"  # 52 + 9: an RFC 1035 label still


def valkey_auth_secret_name(name: str) -> str:
    return names.child_name(name, "valkey-auth")


def metrics_service_name(name: str) -> str:
    return names.child_name(name, "metrics")


def cache_label_value(name: str) -> str:
    """The value of :data:`CACHE_LABEL` on a KVCache's pods (and in selectors of them)."""
    return names.label_value(name)


def shared_tier_kind(spec: KVCacheSpec | Mapping[str, Any]) -> str:
    """``none`` | ``valkey-managed`` | ``valkey-external`` | ``s3`` (status.sharedTier)."""
    if not isinstance(spec, KVCacheSpec):
        spec = KVCache.parse({"spec": spec}).spec
    return spec.shared.kind


def valkey_url(kvcache: KVCache) -> str:
    """The URL the sidecars use: the managed client Service, or the external URL."""
    external = kvcache.spec.shared.valkey_or_default.external
    if external is not None:
        if not external.url:
            raise SpecError("spec.shared.valkey.external.url: required for an external Valkey")
        return external.url
    return f"redis://{valkey_name(kvcache.name)}.{kvcache.namespace}.svc:{VALKEY_PORT}/0"


def _valkey_section(kvcache: KVCache) -> dict[str, Any]:
    shared = kvcache.spec.shared
    valkey = shared.valkey_or_default
    external = valkey.external
    out: dict[str, Any] = {"url": valkey_url(kvcache)}
    if external is not None:
        out["cluster"] = external.cluster
        if external.username:
            out["username"] = external.username
        if external.password_secret_ref is not None:
            out["password_file"] = VALKEY_PASSWORD_FILE
        tls = external.tls
        if tls is not None and tls.ca_secret_ref is not None:
            out["tls_ca_file"] = VALKEY_CA_FILE
        out["tls_insecure_skip_verify"] = tls is not None and tls.insecure_skip_verify
    elif shared.managed_valkey.auth_enabled:
        # The managed Valkey's ACL user for the sidecars, limited to this
        # cache's key prefix (resources.valkey_acl_args).
        out["username"] = MANAGED_VALKEY_USER
        out["password_file"] = VALKEY_PASSWORD_FILE
    if valkey.ttl_seconds is not None:
        out["ttl_seconds"] = valkey.ttl_seconds
    # Each KVCache its own key space: two caches on one Valkey with one prefix
    # would read each other's chunks. An ACL user limited to ~<prefix>* makes
    # that a server-side rule (see the README's Security section).
    out["key_prefix"] = valkey_key_prefix(kvcache)
    return out


def valkey_key_prefix(kvcache: KVCache) -> str:
    """The key prefix of a KVCache's chunks: the spec's, else one unique to it."""
    valkey = kvcache.spec.shared.valkey_or_default
    return valkey.key_prefix or default_key_prefix(kvcache.name, kvcache.namespace)


def default_key_prefix(name: str, namespace: str) -> str:
    """The Valkey key prefix of a KVCache that names none: unique per KVCache."""
    return f"kvstrata:{namespace}/{name}:"


def s3_prefix(kvcache: KVCache) -> str:
    """The object prefix of a KVCache's chunks: the spec's, else one unique to it,
    so two KVCaches on one bucket never share objects (and a bucket policy can
    confine each one's credentials to ``<prefix>*``)."""
    prefix = kvcache.spec.shared.s3_or_default.prefix
    return prefix if prefix else f"kvstrata/{kvcache.namespace}/{kvcache.name}/"


# Reads refresh an object once it is this far into its expiry, and at least
# daily: the sweeper's "least recently used" is then accurate to a day.
REFRESH_FRACTION = 0.5
REFRESH_AT_MOST_SECONDS = 86400.0


def s3_max_size_bytes(kvcache: KVCache) -> int | None:
    """``spec.shared.s3.maxSize`` in bytes (None: no cap); SpecError naming the field."""
    value = kvcache.spec.shared.s3_or_default.max_size
    if value is None:
        return None
    try:
        size = parse_quantity(value)
    except ValueError as exc:
        raise SpecError(f"spec.shared.s3.maxSize: {exc}") from None
    if size <= 0:
        raise SpecError(f"spec.shared.s3.maxSize: must be > 0, got {value!r}")
    return size


def s3_refresh_after_seconds(kvcache: KVCache) -> float | None:
    """When a read refreshes an object: with an expiry or a size cap, else never."""
    s3 = kvcache.spec.shared.s3_or_default
    if s3.expiry_days is not None:
        return min(s3.expiry_days * 86400.0 * REFRESH_FRACTION, REFRESH_AT_MOST_SECONDS)
    if s3.max_size is not None:
        return REFRESH_AT_MOST_SECONDS
    return None


def _s3_section(kvcache: KVCache) -> dict[str, Any]:
    s3 = kvcache.spec.shared.s3_or_default
    if not s3.bucket:
        raise SpecError("spec.shared.s3.bucket: required when spec.shared.backend is s3")
    out: dict[str, Any] = {
        "endpoint_url": s3.endpoint or None,
        "region": s3.region,
        "bucket": s3.bucket,
        "prefix": s3_prefix(kvcache),
        # The operator creates the bucket (spec.shared.s3.createBucket); the
        # sidecars then need no CreateBucket permission.
        "create_bucket": False,
    }
    if s3.credentials_secret_ref is not None:
        out["access_key_id_file"] = S3_ACCESS_KEY_FILE
        out["secret_access_key_file"] = S3_SECRET_KEY_FILE
    s3_max_size_bytes(kvcache)  # a bad maxSize is refused here, with the spec's field name
    refresh = s3_refresh_after_seconds(kvcache)
    if refresh is not None:
        out["refresh_after_seconds"] = refresh
    return out


def sidecar_config_dict(kvcache: KVCache) -> dict[str, Any]:
    """Translate a KVCache spec into SidecarConfig fields (not yet validated)."""
    spec = kvcache.spec
    shared = spec.shared
    out: dict[str, Any] = {
        "chunk_size": spec.chunk_size,
        "transfer_mode": spec.transfer_mode,
        "log_level": spec.log_level,
        "l1": {"size_bytes": spec.l1.size, "policy": spec.l1.policy},
        "l2": {"enabled": spec.l2.enabled, "path": L2_DIR, "size_bytes": spec.l2.size},
        "shared": {
            "backend": shared.backend,
            "codec": shared.codec,
            "admission": shared.admission,
        },
        "server": {"endpoint": ENDPOINT, "http_port": spec.metrics.port},
        "encryption": {"mode": spec.encryption.mode},
    }
    if spec.encryption.mode != "off":
        out["encryption"]["key_dir"] = ENCRYPTION_KEY_DIR
    if shared.backend == "valkey":
        out["shared"]["valkey"] = _valkey_section(kvcache)
    elif shared.backend == "s3":
        out["shared"]["s3"] = _s3_section(kvcache)
    if spec.tenants:
        out["tenants"] = [_tenant(t) for t in spec.tenants]  # none: the cache-wide settings
    return out


def _tenant(tenant: TenantSpec) -> dict[str, Any]:
    """One ``spec.tenants[]`` item as the sidecar's ``tenants[]`` (tenant_config)."""
    budgets = {
        f"{tier}_bytes": value
        for tier, value in (
            ("l1", tenant.budgets.l1),
            ("l2", tenant.budgets.l2),
            ("shared", tenant.budgets.shared),
        )
        if value is not None
    }
    match = tenant.match
    out: dict[str, Any] = {
        "name": tenant.name,
        "match": {
            "cache_salts": list(match.cache_salts),
            "cache_salt_prefixes": list(match.cache_salt_prefixes),
            "models": list(match.models),
        },
        "budgets": budgets,
        "pinned": tenant.pinned,
        "memory_only": tenant.memory_only,
    }
    if tenant.ttl_seconds is not None:
        out["ttl_seconds"] = tenant.ttl_seconds
    return out


def render_sidecar_config(kvcache: KVCacheLike) -> tuple[SidecarConfig, str]:
    """The validated config and the ``sidecar.yaml`` text for one KVCache.

    Raises :class:`SpecError` (a ``ValueError``) carrying the loader's
    field-naming message when the sidecar would refuse the result.
    """
    kvcache = KVCache.parse(kvcache)
    data = sidecar_config_dict(kvcache)
    try:
        config = config_from_dict(data, source=f"KVCache {kvcache.namespace}/{kvcache.name}")
    except ConfigError as exc:
        raise SpecError(str(exc)) from None
    return config, dump_config(config)


def config_hash(kvcache: KVCacheLike, config_text: str) -> str:
    """A short digest of everything that shapes an injected pod.

    Covers the rendered config and the spec as written (sidecar image,
    resources, volumes), so any change that needs new pods changes the hash
    and rolls the workloads.
    """
    raw_spec = kvcache.raw_spec if isinstance(kvcache, KVCache) else kvcache.get("spec") or {}
    digest = hashlib.sha256(config_text.encode())
    digest.update(json.dumps(raw_spec, sort_keys=True).encode())
    return digest.hexdigest()[:16]
