"""Which tenant a request is: from its ``cache_salt``, by the sidecar's rules.

Why a module of its own: the scheduler role names a tenant with every save
it plans (:class:`~.metadata.RequestTransfer`'s ``tenant``), and the rules
come from the sidecar (HELLO's ``tenants``: each tenant's exact salts and
salt prefixes, only the tenants of this session's model). The sidecar
checks every name it is sent; this side only picks one.

A salt listed exactly wins over any prefix; among prefixes the longest
wins (ties: the first tenant listed). A request with no salt, or one no
tenant claims, is the default tenant (""), which the cache-wide settings
govern.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstrata.sidecar import protocol as p

__all__ = ["TenantMatcher"]


class TenantMatcher:
    """The tenant of a ``cache_salt`` under one HELLO's rules (module docstring)."""

    def __init__(self) -> None:
        self._rules: Sequence[p.TenantMatchInfo] | None = None
        self._exact: dict[str, str] = {}
        self._prefixes: list[tuple[str, str]] = []

    def tenant_of(self, cache_salt: str | None, rules: Sequence[p.TenantMatchInfo]) -> str:
        """The tenant name of a request salted ``cache_salt``; "" for the default."""
        if not cache_salt or not rules:
            return ""
        if rules is not self._rules:  # a new session: its HELLO's rules
            self._learn(rules)
        name = self._exact.get(cache_salt)
        if name is not None:
            return name
        for prefix, name in self._prefixes:
            if cache_salt.startswith(prefix):
                return name
        return ""

    def _learn(self, rules: Sequence[p.TenantMatchInfo]) -> None:
        self._rules = rules
        self._exact = {}
        for rule in rules:
            for salt in rule.cache_salts:
                self._exact.setdefault(salt, rule.name)
        prefixes = [(prefix, rule.name) for rule in rules for prefix in rule.cache_salt_prefixes]
        # Longest first; sorted() keeps the listed order among equal lengths.
        self._prefixes = sorted(prefixes, key=lambda item: -len(item[0]))
