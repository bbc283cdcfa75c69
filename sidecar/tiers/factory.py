"""Build the shared (L3) tier the config asks for.

The sidecar calls :func:`build_shared_tier` once at start and hands the
result to ``StorageManager(config, shared_tier=...)``. Only the chosen
backend's client library is imported, so a Valkey sidecar never loads boto3.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from kvstrata.sidecar.config import SharedConfig
from kvstrata.sidecar.tiers.base import Tier

if TYPE_CHECKING:
    from kvstrata.sidecar.sealing import KeyRing


def build_shared_tier(
    config: SharedConfig,
    tenant_ttl_seconds: Mapping[str, float] | None = None,
    keys: KeyRing | None = None,
    tenant_budgets: Mapping[str, int] | None = None,
) -> Tier | None:
    """The configured tier, or None for ``backend: none``.

    Raises ``ValueError`` naming the field for config the tier cannot use
    (an unreadable secret file, a malformed URL). An unreachable server is
    not an error here: the tier starts degraded and recovers by itself.
    ``tenant_ttl_seconds``: tenants' TTLs, which Valkey applies per key and S3
    writes into each object and checks on every read. ``tenant_budgets``:
    tenants' ``budgets.shared_bytes``, which Valkey keeps in a ledger on the
    server (S3 has none: the config refuses them there).
    """
    if config.backend == "none":
        return None
    if config.backend == "valkey":
        from kvstrata.sidecar.tiers.valkey import ValkeyTier

        return ValkeyTier(config, tenant_ttl_seconds, keys=keys, tenant_budgets=tenant_budgets)
    if config.backend == "s3":
        from kvstrata.sidecar.tiers.s3 import S3Tier

        return S3Tier(config, keys=keys, tenant_ttl_seconds=tenant_ttl_seconds)
    raise ValueError(f"shared.backend: unknown backend {config.backend!r}")
