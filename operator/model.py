"""The ``KVCache`` custom resource as typed models, parsed once per pass.

Why this module exists: reconcile, the webhook and the renderers all read the
same spec; parsing it here once gives them typed fields with the CRD's
defaults (``crds/kvcache.yaml``), instead of each module repeating
``(x.get(...) or {})`` chains and default values of its own. A test walks the
CRD schema and checks every default here against it.

Mapping to the CRD: a field with a ``default:`` in the schema has that default
here (an object defaulted to ``{}`` is its model with its own defaults); a
field without one is ``None`` when absent, so presence stays visible (an
``external`` Valkey, a ``credentialsSecretRef``). Values the sidecar's loader
checks (sizes, policies, ranges) are passed through as written, so its
field-naming message is the one a user sees. The models are tolerant: unknown
fields are ignored (the API server prunes them already) and an explicit null
reads as absent.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.alias_generators import to_camel

# Default keys inside the Secrets a KVCache refers to, and the file names the
# sidecar reads them from (the same names, under the Secret's mount).
PASSWORD_KEY = "password"
CA_KEY = "ca.crt"
ACCESS_KEY_ID_KEY = "access-key-id"
SECRET_ACCESS_KEY_KEY = "secret-access-key"

DEFAULT_METRICS_PORT = 9464  # the sidecar's /metrics, /healthz and /readyz

# int-or-string in the CRD: bytes, or a quantity such as "1Gi".
Quantity = int | str


class SpecError(ValueError):
    """A KVCache spec that cannot be rendered; the message names the field."""


class _Model(BaseModel):
    """camelCase as in the CRD, immutable, tolerant of unknown fields and nulls."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="ignore", frozen=True
    )

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            return {k: v for k, v in data.items() if v is not None}
        return data


class L1Spec(_Model):
    size: Quantity = "1Gi"
    policy: str = "lru"


class L2Volume(_Model):
    type: str = "emptyDir"
    medium: str | None = None
    storage_class_name: str | None = None
    claim_name: str | None = None


class L2Spec(_Model):
    enabled: bool = True
    size: Quantity = "4Gi"
    volume: L2Volume = Field(default_factory=L2Volume)


class Persistence(_Model):
    enabled: bool = False
    size: Quantity = "8Gi"
    storage_class_name: str | None = None


class ValkeyAuth(_Model):
    enabled: bool = True


class ManagedValkey(_Model):
    replicas: int = 1
    image: str | None = None
    max_memory: Quantity | None = None
    resources: dict[str, Any] | None = None
    persistence: Persistence | None = None
    auth: ValkeyAuth | None = None

    @property
    def auth_enabled(self) -> bool:
        """A generated password, unless ``auth.enabled`` is false (absent ``auth``: on)."""
        return self.auth is None or self.auth.enabled

    @property
    def persistence_or_default(self) -> Persistence:
        return self.persistence or Persistence()


class PasswordSecretRef(_Model):
    name: str | None = None
    key: str = PASSWORD_KEY


class CASecretRef(_Model):
    name: str | None = None
    key: str = CA_KEY


class ValkeyTLS(_Model):
    ca_secret_ref: CASecretRef | None = None
    insecure_skip_verify: bool = False


class ExternalValkey(_Model):
    url: str | None = None  # required by the CRD; checked where it is rendered
    cluster: bool = False
    username: str | None = None
    password_secret_ref: PasswordSecretRef | None = None
    tls: ValkeyTLS | None = None


class ValkeySpec(_Model):
    ttl_seconds: int | None = None
    key_prefix: str | None = None
    managed: ManagedValkey | None = None
    external: ExternalValkey | None = None


class S3Credentials(_Model):
    name: str | None = None
    access_key_id_key: str = ACCESS_KEY_ID_KEY
    secret_access_key_key: str = SECRET_ACCESS_KEY_KEY


class S3Spec(_Model):
    endpoint: str | None = None
    region: str = "us-east-1"
    bucket: str | None = None  # required by the CRD; checked where it is rendered
    prefix: str | None = None  # default: one per KVCache (spec.s3_prefix)
    create_bucket: bool = False
    credentials_secret_ref: S3Credentials | None = None
    expiry_days: int | None = None  # a lifecycle rule on the prefix (operator/s3bounds.py)
    max_size: Quantity | None = None  # the operator's LRU sweeper keeps the prefix below it


class SharedSpec(_Model):
    backend: str = "none"
    codec: str = "none"
    admission: str = "all"
    valkey: ValkeySpec | None = None
    s3: S3Spec | None = None

    @property
    def valkey_or_default(self) -> ValkeySpec:
        return self.valkey or ValkeySpec()

    @property
    def managed_valkey(self) -> ManagedValkey:
        """The managed Valkey's settings (all defaults when ``managed`` is absent)."""
        return self.valkey_or_default.managed or ManagedValkey()

    @property
    def s3_or_default(self) -> S3Spec:
        return self.s3 or S3Spec()

    @property
    def kind(self) -> str:
        """``none`` | ``valkey-managed`` | ``valkey-external`` | ``s3`` (status.sharedTier)."""
        if self.backend == "valkey":
            external = self.valkey_or_default.external is not None
            return "valkey-external" if external else "valkey-managed"
        return self.backend


class SidecarSpec(_Model):
    image: str | None = None
    image_pull_policy: str | None = None
    resources: dict[str, Any] | None = None
    env: list[dict[str, Any]] | None = None
    security_context: dict[str, Any] | None = None


class ServiceMonitorSpec(_Model):
    enabled: bool = False
    interval: str = "30s"
    labels: dict[str, str] | None = None


class MetricsSpec(_Model):
    port: int = DEFAULT_METRICS_PORT
    service_monitor: ServiceMonitorSpec | None = None

    @property
    def service_monitor_enabled(self) -> bool:
        return self.service_monitor is not None and self.service_monitor.enabled


class TenantMatchSpec(_Model):
    cache_salts: list[str] = Field(default_factory=list)
    cache_salt_prefixes: list[str] = Field(default_factory=list)
    models: list[str] = Field(default_factory=list)


class TenantBudgetsSpec(_Model):
    l1: Quantity | None = None
    l2: Quantity | None = None
    shared: Quantity | None = None


class TenantSpec(_Model):
    name: str
    match: TenantMatchSpec = Field(default_factory=TenantMatchSpec)
    ttl_seconds: int | None = None
    budgets: TenantBudgetsSpec = Field(default_factory=TenantBudgetsSpec)
    pinned: bool = False
    memory_only: bool = False


class EncryptionSpec(_Model):
    mode: str = "off"  # off | on | required (checked by the sidecar's loader)
    rotate_every: str | None = None  # a duration ("720h", "30d"); None: never rotate


class KVCacheSpec(_Model):
    """``KVCache.spec``; every field defaults as the CRD defaults it."""

    chunk_size: int = 256
    transfer_mode: str = "auto"
    log_level: str = "INFO"
    l1: L1Spec = Field(default_factory=L1Spec)
    l2: L2Spec = Field(default_factory=L2Spec)
    shared: SharedSpec = Field(default_factory=SharedSpec)
    sidecar: SidecarSpec = Field(default_factory=SidecarSpec)
    metrics: MetricsSpec = Field(default_factory=MetricsSpec)
    tenants: list[TenantSpec] | None = None  # no CRD default: absent stays absent
    encryption: EncryptionSpec = Field(default_factory=EncryptionSpec)


@dataclass(frozen=True, slots=True)
class KVCache:
    """One KVCache object: identity from its metadata, the typed spec, and the spec as written.

    ``raw_spec`` is kept for what must see every field, known or not (the
    config hash); everything else reads ``spec``.
    """

    name: str
    namespace: str
    uid: str
    generation: int
    spec: KVCacheSpec
    raw_spec: Mapping[str, Any]
    status: Mapping[str, Any]

    @classmethod
    def parse(cls, obj: KVCache | Mapping[str, Any]) -> KVCache:
        """The typed view of a KVCache object (returned as is when already typed).

        Raises :class:`SpecError` naming the field whose value has the
        wrong type (``spec.l1.size: ...``).
        """
        if isinstance(obj, KVCache):
            return obj
        meta = obj.get("metadata") or {}
        raw_spec = obj.get("spec") or {}
        try:
            spec = KVCacheSpec.model_validate(raw_spec)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(part) for part in ("spec", *first["loc"]))
            raise SpecError(f"{where}: {first['msg']}") from None
        return cls(
            name=str(meta.get("name") or ""),
            namespace=str(meta.get("namespace") or "default"),
            uid=str(meta.get("uid") or ""),
            generation=int(meta.get("generation", 1)),
            spec=spec,
            raw_spec=raw_spec,
            status=obj.get("status") or {},
        )


KVCacheLike = KVCache | Mapping[str, Any]
"""What the operator's public functions take: a parsed KVCache or the object as a dict."""
