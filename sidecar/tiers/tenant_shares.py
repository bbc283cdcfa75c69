"""Per-tenant byte budgets of one tier below L1 (L2 today): what each tenant
holds there, whether a store of it fits, and what was refused.

Why a module of its own: the disk tier owns its index and its lock, so it
must own the tenants' share of it too (its LRU evicts files the engine
never hears about); the rules are the same as L1's (:mod:`..l1`) and live
here rather than in the tier's I/O code.

The rules, per tenant with ``budgets.l2_bytes`` set:

* a store larger than the budget is refused (``budget``);
* a store that would take the tenant past its budget evicts the tenant's
  own least recent files first, or, for a pinned tenant, is refused
  (``pinned_budget``): what a pinned tenant keeps is what it stored first;
* a pinned tenant's files are never evicted for anyone else's store (they
  are within its budget by the rule above); a store that finds no other
  room is dropped.

State (process memory, rebuilt from the files' sealed headers on start)::

    usage:     tenant -> bytes of its files ("" is the default tenant)
    reserved:  tenant -> bytes of its writes in flight
    refusals:  (tenant, reason) -> stores refused
    evictions: tenant -> files evicted by its own budget

Tenant names are the config's: a name the config does not know (a file
sealed for a tenant since removed) is read as the default tenant, so labels
on ``/metrics`` stay the configured ones.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping
from typing import NamedTuple

__all__ = ["TenantFigures", "TenantShares"]


class TenantFigures(NamedTuple):
    """A copy of :class:`TenantShares`' state, for metrics."""

    usage: dict[str, int]
    refusals: dict[tuple[str, str], int]
    evictions: dict[str, int]


class TenantShares:
    """The tenants' budgets in one tier (module docstring). Not thread-safe:
    the tier calls it under its own lock."""

    def __init__(
        self,
        budgets: Mapping[str, int] | None = None,
        pinned: Collection[str] = (),
        known: Collection[str] = (),
    ) -> None:
        """``budgets``: bytes per tenant that has one; ``pinned``: tenants (with a
        budget) whose files others' stores never evict; ``known``: every configured
        tenant's name."""
        self.budgets = dict(budgets or {})
        self.pinned = frozenset(pinned) & frozenset(self.budgets)
        self.known = frozenset(known) | frozenset(self.budgets)
        self.usage: Counter[str] = Counter()
        # Bytes of writes in flight (checked against the budget, not yet in usage):
        # two writer threads must not both fit the last free bytes.
        self.reserved: Counter[str] = Counter()
        self.refusals: Counter[tuple[str, str]] = Counter()
        self.evictions: Counter[str] = Counter()

    def name(self, tenant: str) -> str:
        """``tenant`` if the config knows it, else the default tenant ("")."""
        return tenant if tenant in self.known else ""

    def add(self, tenant: str, delta: int) -> None:
        left = self.usage[tenant] + delta
        if left > 0:
            self.usage[tenant] = left
        else:
            self.usage.pop(tenant, None)

    def refusal(self, tenant: str, nbytes: int) -> str | None:
        """Why a store of ``nbytes`` for ``tenant`` is refused outright, or None."""
        budget = self.budgets.get(tenant)
        if budget is None:
            return None
        if nbytes > budget:
            return "budget"
        if tenant in self.pinned and self._held(tenant) + nbytes > budget:
            return "pinned_budget"
        return None

    def refuse(self, tenant: str, reason: str) -> None:
        self.refusals[(tenant, reason)] += 1

    def over(self, tenant: str, nbytes: int) -> bool:
        """Whether ``nbytes`` more would take ``tenant`` past its budget."""
        budget = self.budgets.get(tenant)
        return budget is not None and self._held(tenant) + nbytes > budget

    def excess(self, tenant: str, nbytes: int) -> int:
        """Bytes of ``tenant``'s to free before ``nbytes`` more fit its budget."""
        budget = self.budgets.get(tenant)
        return 0 if budget is None else self._held(tenant) + nbytes - budget

    def _held(self, tenant: str) -> int:
        return self.usage[tenant] + self.reserved[tenant]

    def reserve(self, tenant: str, nbytes: int) -> None:
        """A write of ``nbytes`` starts (``nbytes`` < 0: it ended, either way)."""
        if tenant in self.budgets:
            self.reserved[tenant] += nbytes

    def protected(self, tenant: str) -> bool:
        """Whether ``tenant``'s files are out of reach of others' stores."""
        return tenant in self.pinned

    def clear(self) -> None:
        self.usage.clear()
