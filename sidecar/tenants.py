"""Per-tenant retention at run time: which tenant a store names, where its
chunks may go, and what each tenant holds, lost and was refused.

Why a module of its own: the rules cut across the tiers (L1 eviction, the
write-behind's choice of tiers, the shared tier's expiry) and the engine
must not grow with them. :class:`TenantRules` answers questions about the
config (:mod:`.tenant_config`); :class:`TenantLedger` is the one owner of
the per-tenant state, kept by the L1 store under the L1 index's lock.

State (process memory only; a restarted sidecar knows no chunk's tenant,
and L2 files written before it count as the default tenant's)::

    l1_bytes:  tenant -> bytes of its entries in the L1 index
    ages:      tier ("l1", "l2") -> tenant -> key -> when it was stored,
               oldest first (tenants with a TTL only)
    refusals:  (tenant, tier, reason) -> stores refused
    evictions: (tenant, tier) -> chunks evicted to make room
    expired:   (tenant, tier) -> chunks removed for their age

The tenant of a chunk travels in its :class:`~.objformat.ChunkMeta`
(``tenant``: "" is the default tenant); labels on ``/metrics`` are the
config's names and ``default`` only, never a string a client sent.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from kvstrata.sidecar.keys import ChunkKey
from kvstrata.sidecar.tenant_config import DEFAULT_TENANT, TenantConfig
from kvstrata.sidecar.tiers.tenant_shares import TenantFigures, TenantShares

__all__ = [
    "LOWER_TIERS",
    "REFUSAL_REASONS",
    "TenantLedger",
    "TenantRules",
    "TenantSnapshot",
    "UnknownTenantError",
    "l2_shares",
    "lower_tiers_for",
    "with_tier",
]

# Why a store was refused (kvstrata_tenant_refusals_total{reason}).
REFUSAL_REASONS = ("budget", "pinned_budget", "not_kept")
# The tiers below L1 a chunk may be written to, as write-behind names them.
LOWER_TIERS = ("l2", "shared")


class UnknownTenantError(ValueError):
    """A store named a tenant the sidecar's config does not know (or one whose
    ``match.models`` excludes the session's model); the message names it."""


def lower_tiers_for(tenant: TenantConfig | None, shared_expires: bool = True) -> frozenset[str]:
    """The tiers below L1 (``"l2"``, ``"shared"``) a chunk of ``tenant``
    (None: the default tenant) may be written to. The one place write-behind
    asks where a chunk goes: any further per-request choice narrows this.
    ``shared_expires``: the shared tier expires each object by its tenant's
    TTL (Valkey); where it cannot (S3: the bucket's lifecycle rule is one
    age for every object), a tenant with a TTL is kept out of it, so that no
    copy outlives the TTL."""
    if tenant is None:
        return frozenset(LOWER_TIERS)
    tiers = frozenset(tier for tier in LOWER_TIERS if tenant.keeps_in(tier))
    if tenant.ttl_seconds is not None and not shared_expires:
        tiers -= {"shared"}
    return tiers


def l2_shares(tenants: Sequence[TenantConfig]) -> TenantShares:
    """The L2 budgets of ``tenants`` (``budgets.l2_bytes``; 0 is "never kept
    there", which write-behind enforces before any write)."""
    return TenantShares(
        budgets={t.name: t.budgets.l2_bytes for t in tenants if t.budgets.l2_bytes},
        pinned=[t.name for t in tenants if t.pinned],
        known=[t.name for t in tenants],
    )


class TenantRules:
    """The configured tenants, by name (read-only after start: thread-safe)."""

    def __init__(self, tenants: Sequence[TenantConfig] = (), shared_expires: bool = True) -> None:
        """``shared_expires``: see :func:`lower_tiers_for`."""
        self.by_name = {t.name: t for t in tenants}
        self.shared_expires = shared_expires
        self.ttl_tenants = {t.name: t.ttl_seconds for t in tenants if t.ttl_seconds is not None}

    def __bool__(self) -> bool:
        return bool(self.by_name)

    def get(self, name: str) -> TenantConfig | None:
        """The tenant named ``name``; None for the default tenant ("")."""
        return self.by_name.get(name) if name else None

    def resolve(self, name: str, model: str) -> str:
        """Check a tenant name a client sent for a session of ``model``: the
        name itself ("" for the default tenant), or :class:`UnknownTenantError`."""
        if not name:
            return ""
        tenant = self.by_name.get(name)
        if tenant is None:
            known = ", ".join(sorted(self.by_name)) or "none configured"
            raise UnknownTenantError(
                f"field 'tenant': unknown tenant {name[:64]!r} (known: {known})"
            )
        if tenant.match.models and model not in tenant.match.models:
            raise UnknownTenantError(
                f"field 'tenant': tenant {name!r} is not on this session's model {model[:64]!r}"
            )
        return name

    def lower_tiers(self, name: str) -> frozenset[str]:
        return lower_tiers_for(self.get(name), self.shared_expires)

    def l1_budget(self, name: str) -> int | None:
        tenant = self.get(name)
        return None if tenant is None else tenant.budgets.l1_bytes

    def pinned(self, name: str) -> bool:
        tenant = self.get(name)
        return tenant is not None and tenant.pinned

    def ttl_seconds(self, name: str) -> float | None:
        return self.ttl_tenants.get(name) if name else None

    @staticmethod
    def label(name: str) -> str:
        """The metrics' label of a (checked) tenant name."""
        return name or DEFAULT_TENANT

    def labels(self) -> list[str]:
        """Every tenant label, default first (series exist from the start)."""
        return [DEFAULT_TENANT, *self.by_name]


@dataclass(frozen=True)
class TenantSnapshot:
    """Per-tenant figures at one moment, labelled (see :class:`TenantLedger`)."""

    labels: list[str] = field(default_factory=lambda: [DEFAULT_TENANT])
    l1_bytes: dict[str, int] = field(default_factory=dict)
    l2_bytes: dict[str, int] | None = None  # None: no L2
    # What the shared tier's ledgers count, budgeted tenants only (None: no budgets).
    shared_bytes: dict[str, int] | None = None
    refusals: dict[tuple[str, str, str], int] = field(default_factory=dict)
    evictions: dict[tuple[str, str], int] = field(default_factory=dict)
    expirations: dict[tuple[str, str], int] = field(default_factory=dict)


def with_tier(snapshot: TenantSnapshot, tier: str, figures: TenantFigures) -> TenantSnapshot:
    """``snapshot`` with a lower tier's own per-tenant figures added, labelled:
    ``l2`` (bytes, refusals, evictions) or ``shared`` (what the budgeted
    tenants' ledgers count, and refusals)."""

    def label(name: str) -> str:
        return name or DEFAULT_TENANT

    refusals = dict(snapshot.refusals)
    for (tenant, reason), n in figures.refusals.items():
        refusals[(label(tenant), tier, reason)] = n
    evictions = dict(snapshot.evictions)
    for tenant, n in figures.evictions.items():
        evictions[(label(tenant), tier)] = n
    held = {label(t): n for t, n in figures.usage.items()}
    if tier == "shared":
        return replace(snapshot, shared_bytes=held, refusals=refusals, evictions=evictions)
    return replace(snapshot, l2_bytes=held, refusals=refusals, evictions=evictions)


class TenantLedger:
    """Per-tenant bytes, ages and counts (module docstring). Not thread-safe:
    its owner (the L1 store) is called under the L1 index's lock."""

    def __init__(self, rules: TenantRules) -> None:
        self.rules = rules
        self.l1_bytes: Counter[str] = Counter()
        self.ages: dict[str, dict[str, OrderedDict[ChunkKey, float]]] = {"l1": {}, "l2": {}}
        self.refusals: Counter[tuple[str, str, str]] = Counter()
        self.evictions: Counter[tuple[str, str]] = Counter()
        self.expirations: Counter[tuple[str, str]] = Counter()

    def refuse(self, tenant: str, tier: str, reason: str) -> None:
        self.refusals[(self.rules.label(tenant), tier, reason)] += 1

    def evicted(self, tenant: str, tier: str) -> None:
        self.evictions[(self.rules.label(tenant), tier)] += 1

    def aged_out(self, tenant: str, tier: str) -> None:
        self.expirations[(self.rules.label(tenant), tier)] += 1

    def snapshot(self) -> TenantSnapshot:
        """A copy for metrics (the caller holds the owner's lock)."""
        return TenantSnapshot(
            labels=self.rules.labels(),
            l1_bytes={self.rules.label(t): n for t, n in self.l1_bytes.items()},
            refusals=dict(self.refusals),
            evictions=dict(self.evictions),
            expirations=dict(self.expirations),
        )

    def stored(self, tier: str, tenant: str, key: ChunkKey, now: float) -> None:
        """``key`` of ``tenant`` is in ``tier`` since ``now``: remembered where
        the tenant has a TTL, to expire it (re-storing it restarts its age)."""
        if self.rules.ttl_seconds(tenant) is None:
            return
        ages = self.ages[tier].setdefault(tenant, OrderedDict())
        ages[key] = now
        ages.move_to_end(key)

    def forget(self, tier: str, tenant: str, key: ChunkKey) -> bool:
        """Stop tracking ``key``'s age in ``tier``; whether it was tracked."""
        ages = self.ages[tier].get(tenant)
        return ages is not None and ages.pop(key, None) is not None

    def expired(self, tier: str, now: float) -> list[tuple[str, ChunkKey]]:
        """(tenant, key) of every chunk in ``tier`` older than its tenant's TTL,
        forgotten here (oldest first: one TTL per tenant, so each tenant's
        ages are in order and the walk stops at its first young chunk)."""
        out: list[tuple[str, ChunkKey]] = []
        for tenant, ages in self.ages[tier].items():
            ttl = self.rules.ttl_seconds(tenant)
            if ttl is None:
                continue
            while ages:
                key, stored = next(iter(ages.items()))
                if now - stored < ttl:
                    break
                del ages[key]
                out.append((tenant, key))
        return out
