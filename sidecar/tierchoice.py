"""Per-request tier choice: the tiers one request may load from and store into.

Why a module of its own: a request names tiers by their role -- ``l1``,
``l2``, ``shared`` -- while the engine names its shared tier after its
backend (``valkey``, ``s3``). This module owns the role names, their check
at the protocol boundary (LOOKUP's ``load_tiers``, PREPARE_STORE's
``store_tiers``; an unknown name is refused naming the field and the name),
and the one question the lookup and write-behind ask: may this request's
chunk come from, or go to, that tier. A choice of ``None`` means every tier
(the field was left out).

Why ``store_tiers`` must hold ``l1``: every store lands in the L1 arena
first and flows down from there, so a choice without L1 could not be kept.
"""

from __future__ import annotations

from typing import Any

from kvstrata.sidecar.wire import E_BAD_REQUEST, ProtocolError, read_list, read_str

__all__ = ["TIER_NAMES", "TierChoice", "allows", "read_tiers", "role_of"]

TIER_NAMES = ("l1", "l2", "shared")

# The role names a request chose; None: every tier.
TierChoice = frozenset[str] | None


def role_of(engine_tier: str) -> str:
    """The role name of one of the engine's tiers ("valkey" and "s3" are "shared")."""
    return engine_tier if engine_tier in ("l1", "l2") else "shared"


def allows(choice: TierChoice, engine_tier: str) -> bool:
    """Whether ``choice`` lets a chunk come from, or go to, ``engine_tier``."""
    return choice is None or role_of(engine_tier) in choice


def read_tiers(value: Any, name: str, need_l1: bool = False) -> TierChoice:
    """A ``load_tiers`` / ``store_tiers`` field: None when absent, else the names
    (each one of :data:`TIER_NAMES`; not empty; with ``l1`` when ``need_l1``)."""
    if value is None:
        return None
    items = read_list(value, name, len(TIER_NAMES))
    if not items:
        raise ProtocolError(E_BAD_REQUEST, f"field {name!r}: empty (leave it out for every tier)")
    names = []
    for i, item in enumerate(items):
        tier = read_str(item, f"{name}[{i}]", 16)
        if tier not in TIER_NAMES:
            raise ProtocolError(
                E_BAD_REQUEST,
                f"field {name!r}: unknown tier {tier!r} (known: {', '.join(TIER_NAMES)})",
            )
        names.append(tier)
    if need_l1 and "l1" not in names:
        raise ProtocolError(
            E_BAD_REQUEST, f"field {name!r}: must include 'l1' (every store lands in L1 first)"
        )
    return frozenset(names)
