"""The ``tenants`` section of the sidecar's config: who a tenant is and what
the cache may keep of it.

Why a module of its own: the schema's other sections describe tiers; this
one describes retention rules that cut across them, and both the runtime
rules (:mod:`.tenants`) and the operator's renderer read it.

A tenant is matched per request by the connector, from vLLM's
``cache_salt`` (exact values or prefixes) and, optionally, the model its
session serves; a request that matches none belongs to the default tenant,
which the cache-wide settings govern. As YAML::

    tenants:
      - name: team-a                 # DNS label; the metrics' tenant label
        match:
          cache_salts: [team-a]      # exact cache_salt values
          cache_salt_prefixes: []    # or cache_salt prefixes
          models: []                 # and the session's model (empty: any)
        ttl_seconds: 86400           # a chunk older than this is a miss (none: no limit)
        budgets:                     # bytes per tier (none: no budget, 0: never kept)
          l1_bytes: 20Gi
          l2_bytes: null
          shared_bytes: null         # all sidecars together (Valkey only; needs a TTL)
        pinned: true                 # others' pressure never evicts it within l1_bytes
                                     # (and within l2_bytes in L2, when set)
        memory_only: false           # never written to L2 or the shared tier
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, Field, model_validator

from kvstrata.sidecar.config_base import ByteSize, ConfigSection

__all__ = [
    "DEFAULT_TENANT",
    "TenantBudgets",
    "TenantConfig",
    "TenantMatch",
    "check_shared_budgets",
    "check_tenants",
]

# The label value of chunks no tenant claims (a name no tenant may take).
DEFAULT_TENANT = "default"
_NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
MAX_MATCH_VALUES = 256
MAX_SALT_CHARS = 256


def _tenant_name(value: str) -> str:
    if not _NAME_RE.match(value):
        raise ValueError(
            f"a tenant name is a DNS label (lower case letters, digits, '-'; at most 63), "
            f"got {value!r}"
        )
    if value == DEFAULT_TENANT:
        raise ValueError(f"{DEFAULT_TENANT!r} names the chunks no tenant claims, got {value!r}")
    return value


def _salts(values: list[str]) -> list[str]:
    for value in values:
        if not value or len(value) > MAX_SALT_CHARS:
            raise ValueError(
                f"a cache_salt value is 1..{MAX_SALT_CHARS} characters, got {value[:40]!r}"
            )
    return values


SaltList = Annotated[list[str], AfterValidator(_salts), Field(max_length=MAX_MATCH_VALUES)]


class TenantMatch(ConfigSection):
    """Which requests are the tenant's: any listed salt or salt prefix, and
    (when ``models`` is set) only on sessions of those models."""

    cache_salts: SaltList = Field(
        default_factory=list, description="cache_salt values of the tenant's requests"
    )
    cache_salt_prefixes: SaltList = Field(
        default_factory=list, description="cache_salt prefixes of the tenant's requests"
    )
    models: list[str] = Field(
        default_factory=list,
        max_length=MAX_MATCH_VALUES,
        description="models (the session namespace's model) the tenant is on; empty: any",
    )

    def salt_matches(self, salt: str) -> bool:
        return salt in self.cache_salts or any(salt.startswith(p) for p in self.cache_salt_prefixes)


class TenantBudgets(ConfigSection):
    """Most bytes the tenant's chunks hold per tier; None: no budget of its
    own (the tier's size and namespace quota still apply); 0: never kept there."""

    l1_bytes: ByteSize | None = Field(None, description="bytes in the L1 arena")
    l2_bytes: ByteSize | None = Field(
        None,
        description="bytes in L2: a store past it evicts the tenant's own least recent "
        "files (a pinned tenant's is refused); 0: never written there",
    )
    shared_bytes: ByteSize | None = Field(
        None,
        description="bytes of the tenant's objects in the shared tier, all sidecars of the "
        "cache together: a store past it is refused (counted, the chunk stays in L1/L2); "
        "0: never written there. Enforced by Valkey (a ledger on the server; needs the "
        "tenant's ttl_seconds or shared.valkey.ttl_seconds); refused with S3",
    )


class TenantConfig(ConfigSection):
    """One tenant: how its requests are recognised and what the cache keeps of them
    (``kvstrata.sidecar.tenant_config``)."""

    name: Annotated[str, AfterValidator(_tenant_name)] = Field(
        description="the tenant's name: what the connector sends and the metrics' label"
    )
    match: TenantMatch = Field(default_factory=TenantMatch)
    ttl_seconds: float | None = Field(
        None, gt=0, description="a chunk older than this is a miss and is removed"
    )
    budgets: TenantBudgets = Field(default_factory=TenantBudgets)
    pinned: bool = Field(
        False,
        description="other tenants' stores never evict its L1 chunks (nor its L2 files "
        "when budgets.l2_bytes is set); a store past its budget is refused instead of "
        "evicting its own",
    )
    memory_only: bool = Field(False, description="never written to L2 or the shared tier")

    @model_validator(mode="after")
    def _check(self) -> TenantConfig:
        match = self.match
        if not (match.cache_salts or match.cache_salt_prefixes or match.models):
            raise ValueError(
                f"tenant {self.name!r}: match needs cache_salts, cache_salt_prefixes or models"
            )
        if self.pinned and self.budgets.l1_bytes is None:
            raise ValueError(
                f"tenant {self.name!r}: a pinned tenant needs budgets.l1_bytes "
                "(it may hold only that much out of everyone's reach)"
            )
        return self

    def keeps_in(self, tier: str) -> bool:
        """Whether the tenant's chunks may be written to ``tier`` ("l2", "shared")."""
        if self.memory_only:
            return False
        budget = self.budgets.l2_bytes if tier == "l2" else self.budgets.shared_bytes
        return budget != 0


def check_shared_budgets(tenants: list[TenantConfig], backend: str, tier_ttl: bool) -> None:
    """A tenant's ``budgets.shared_bytes`` > 0 is refused where it would not
    hold: S3 has no atomic counter on the server to keep one budget for every
    sidecar, and a Valkey ledger frees an object's bytes only when the object
    expires (``tier_ttl``: ``shared.valkey.ttl_seconds`` is set)."""
    for i, tenant in enumerate(tenants):
        if not tenant.budgets.shared_bytes:
            continue
        where = f"tenants.{i}.budgets.shared_bytes ({tenant.name!r})"
        if backend == "s3":
            raise ValueError(
                f"{where}: shared.backend s3 cannot enforce a byte budget (S3 has no atomic "
                "counter shared by all sidecars); use 0 or unset, or shared.backend valkey, "
                "which enforces it"
            )
        if backend == "valkey" and tenant.ttl_seconds is None and not tier_ttl:
            raise ValueError(
                f"{where}: a Valkey budget needs an expiry (its bytes are freed when its "
                "objects expire): set the tenant's ttl_seconds or shared.valkey.ttl_seconds"
            )


def check_tenants(tenants: list[TenantConfig]) -> list[TenantConfig]:
    """Names are unique (the connector and the metrics name tenants by them)."""
    seen: set[str] = set()
    for tenant in tenants:
        if tenant.name in seen:
            raise ValueError(f"tenant name {tenant.name!r} is used twice")
        seen.add(tenant.name)
    return tenants
