"""A request's tier choice, read from the ``kv_transfer_params`` of its body.

vLLM hands the connector the ``kv_transfer_params`` dict of an OpenAI
request unchanged (``Request.kv_transfer_params``). kvstrata reads two
spellings of the same choice, so that a request written for vLLM's own
offloading connector works here as it is:

* its own, under the ``kvstrata`` key::

      {"kvstrata": {"load_tiers": ["l1", "l2"], "store_tiers": ["l1"], "store": true}}

  tiers by role: ``l1`` (the sidecar's memory), ``l2`` (its local disk),
  ``shared`` (Valkey or S3, shared between pods);
* vLLM's: ``kv_load_tiers`` / ``kv_store_tiers``, lists of matchers
  ``{"medium": "cpu" | "storage", "locality": "local" | "remote"}`` (either
  key may be left out, matching both values): ``cpu``+``local`` is L1,
  ``storage``+``local`` L2, ``storage``+``remote`` the shared tier.

A list that is left out means every tier; an empty one means none (no
lookup, or no store). ``"store": false`` stores nothing. A stored chunk
always lands in L1 first (the arena both processes map), so L1 is added to
any store choice that names a tier below it.

Anything else -- an unknown key, a tier name or matcher value not listed
above, a wrong type, both spellings of one list -- is refused with
:class:`KVTransferParamsError` naming the field, never guessed at: a
privacy choice read wrongly would store what the user asked to keep out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvstrata.sidecar.tierchoice import TIER_NAMES

__all__ = ["EVERY_TIER", "KVTransferParamsError", "RequestTiers", "parse_request_tiers"]

ROOT = "kv_transfer_params"
OWN_KEY = "kvstrata"
NATIVE_LOAD, NATIVE_STORE = "kv_load_tiers", "kv_store_tiers"
OWN_FIELDS = ("load_tiers", "store_tiers", "store")

# vLLM's tier matchers ({medium, locality}) -> the kvstrata tiers each matches.
_MEDIUMS = {"cpu": {"l1"}, "storage": {"l2", "shared"}}
_LOCALITIES = {"local": {"l1", "l2"}, "remote": {"shared"}}


class KVTransferParamsError(ValueError):
    """``kv_transfer_params`` holds something kvstrata does not take; the
    message names the field (``kv_transfer_params.kvstrata.load_tiers[1]``)."""


@dataclass(frozen=True, slots=True)
class RequestTiers:
    """Where one request may load from and store to (None: every tier; an
    empty set: none)."""

    load: frozenset[str] | None = None
    store: frozenset[str] | None = None

    @property
    def loads(self) -> bool:
        return self.load is None or bool(self.load)

    @property
    def stores(self) -> bool:
        return self.store is None or bool(self.store)


EVERY_TIER = RequestTiers()
# What a request whose params could not be read gets where no check refused it
# first: no load and no store, so that a choice misread is never acted on.
NOTHING = RequestTiers(load=frozenset(), store=frozenset())


def parse_request_tiers(params: Mapping[str, Any] | None) -> RequestTiers:
    """The tier choice of ``params`` (a request's ``kv_transfer_params``)."""
    if params is None:
        return EVERY_TIER
    if not isinstance(params, Mapping):
        raise KVTransferParamsError(f"{ROOT}: expected an object, got {type(params).__name__}")
    unknown = sorted(str(k) for k in params if k not in (OWN_KEY, NATIVE_LOAD, NATIVE_STORE))
    if unknown:
        known = ", ".join((OWN_KEY, NATIVE_LOAD, NATIVE_STORE))
        raise KVTransferParamsError(f"{ROOT}: unknown key {unknown[0]!r} (known: {known})")
    own = _own_section(params.get(OWN_KEY))
    load = _one_of(own, "load_tiers", params, NATIVE_LOAD)
    store = _one_of(own, "store_tiers", params, NATIVE_STORE)
    store_flag = own.get("store", True)
    if not isinstance(store_flag, bool):
        raise KVTransferParamsError(
            f"{ROOT}.{OWN_KEY}.store: expected true or false, got {store_flag!r}"
        )
    if not store_flag:
        if store is not None:
            raise KVTransferParamsError(
                f"{ROOT}.{OWN_KEY}.store is false: leave the store tiers out"
            )
        store = frozenset()
    elif store:
        store = store | {"l1"}  # every store lands in L1 first (module docstring)
    return RequestTiers(load=load, store=store)


def _own_section(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise KVTransferParamsError(
            f"{ROOT}.{OWN_KEY}: expected an object, got {type(value).__name__}"
        )
    for key in value:
        if key not in OWN_FIELDS:
            raise KVTransferParamsError(
                f"{ROOT}.{OWN_KEY}: unknown key {str(key)!r} (known: {', '.join(OWN_FIELDS)})"
            )
    return dict(value)


def _one_of(
    own: Mapping[str, Any], own_name: str, params: Mapping[str, Any], native_name: str
) -> frozenset[str] | None:
    """One list from either spelling (both given is refused)."""
    if own_name in own and native_name in params:
        raise KVTransferParamsError(f"{ROOT}: give {OWN_KEY}.{own_name} or {native_name}, not both")
    if own_name in own:
        return _role_names(own[own_name], f"{ROOT}.{OWN_KEY}.{own_name}")
    if native_name in params:
        return _matchers(params[native_name], f"{ROOT}.{native_name}")
    return None


def _role_names(value: Any, name: str) -> frozenset[str]:
    if not isinstance(value, list):
        raise KVTransferParamsError(f"{name}: expected a list of tier names, got {value!r}")
    for i, tier in enumerate(value):
        if tier not in TIER_NAMES:
            raise KVTransferParamsError(
                f"{name}[{i}]: unknown tier {tier!r} (known: {', '.join(TIER_NAMES)})"
            )
    return frozenset(value)


def _matchers(value: Any, name: str) -> frozenset[str]:
    if not isinstance(value, list):
        raise KVTransferParamsError(f"{name}: expected a list of tier matchers, got {value!r}")
    tiers: set[str] = set()
    for i, matcher in enumerate(value):
        if not isinstance(matcher, Mapping):
            raise KVTransferParamsError(
                f'{name}[{i}]: expected an object like {{"medium": "cpu"}}, got {matcher!r}'
            )
        matched = set(TIER_NAMES)
        for key, table in (("medium", _MEDIUMS), ("locality", _LOCALITIES)):
            if key in matcher:
                chosen = matcher[key]
                if not isinstance(chosen, str) or chosen.lower() not in table:
                    raise KVTransferParamsError(
                        f"{name}[{i}].{key}: unknown value {chosen!r} (known: {', '.join(table)})"
                    )
                matched &= table[chosen.lower()]
        extra = sorted(str(k) for k in matcher if k not in ("medium", "locality"))
        if extra:
            raise KVTransferParamsError(
                f"{name}[{i}]: unknown key {extra[0]!r} (known: medium, locality)"
            )
        tiers |= matched
    return frozenset(tiers)
