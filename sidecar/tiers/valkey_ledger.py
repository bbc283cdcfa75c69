"""Per-tenant byte budgets in the Valkey tier (``tenants[].budgets.shared_bytes``),
kept by the server so that every sidecar on the tier enforces one budget.

Why a ledger on the server: the tier is shared between sidecars (every pod
of a KVCache writes into it), so no one sidecar sees what a tenant holds
there. Each tenant of each key prefix gets a ledger of the objects stored
for it, and one Lua script both reads and changes it, so two sidecars
storing at the same moment can never both fit the last free bytes.

State on the server, per budgeted tenant (both keys carry the hash tag
``{tenant}`` so a Valkey Cluster keeps them in one slot)::

    <key_prefix>budget:{<tenant>}:expiry   sorted set: object name -> when
                                           it expires (server time, ms)
    <key_prefix>budget:{<tenant>}:bytes    hash: object name -> its bytes,
                                           and ":total" -> their sum

Both expire a moment after their last member, so a ledger no sidecar
uses any more leaves no keys behind; the tier's ``clear`` (every key
under the prefix) removes them with the objects.

A store of a budgeted tenant (:meth:`SharedBudgets.reserve`, before its
``SET NX PX``):

1. members whose expiry has passed leave the ledger and its total (at most
   :data:`PURGE_AT_ONCE` a call; what is left over is purged by the next);
2. an object the ledger already holds is not reserved again (``HELD``):
   another writer has it, and the tier only asks whether it is there;
3. an object that fits (total + its bytes <= budget) is added
   (``RESERVED``), else refused (``REFUSED``).

A reservation whose ``SET NX`` did not store (the object was already
there, or the call failed) is given back (:meth:`SharedBudgets.give_back`).
What a ledger counts (its total less the members already expired) is read
for the metrics by :meth:`SharedBudgets.usage`, which changes nothing.

The ledger counts an object until its expiry, so it may count more than
the tenant holds, never less: an object the server evicted under
``maxmemory`` stays counted until it would have expired, and a give-back
that fails (the server gone) leaves its reservation until then. A tenant
is thus refused early, never let past its budget. The one exception: if
the server evicts one of the two keys of a ledger, the ledger starts
afresh (a total without its members could never go down), and may admit
up to a budget more until what it forgot has expired. An object without
an expiry would hold its bytes forever, so the config refuses a shared
budget without a TTL (the tenant's ``ttl_seconds`` or
``shared.valkey.ttl_seconds``).

Budgets count the stored objects' bytes (header, payload after the codec,
trailer), not the server's per-key overhead.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from kvstrata.sidecar.tiers.tenant_shares import TenantFigures

__all__ = ["HELD", "REFUSED", "RESERVED", "UNBUDGETED", "NotStored", "SharedBudgets"]

# What reserve answers for each object (the script's replies, and UNBUDGETED
# for a tenant the ledger does not track).
REFUSED = 0
RESERVED = 1
HELD = 2
UNBUDGETED = 3

# Expired members purged in one call: bounds the script's run time, during
# which the server answers no one else.
PURGE_AT_ONCE = 1000
# How long a ledger outlives its last member (ms).
_LINGER_MS = 1000
_TOTAL = ":total"

# Ends every script that changes a ledger: the total written back, or the
# ledger deleted when it holds nothing, and both keys set to expire with
# their last member.
_FINISH = f"""
if redis.call('ZCARD', z) == 0 then
  redis.call('DEL', z, h)
else
  if total < 0 then total = 0 end
  redis.call('HSET', h, '{_TOTAL}', string.format('%d', total))
  local last = redis.call('ZRANGE', z, -1, -1, 'WITHSCORES')
  local at = string.format('%d', tonumber(last[2]) + {_LINGER_MS})
  redis.call('PEXPIREAT', z, at)
  redis.call('PEXPIREAT', h, at)
end
"""

# The start of every script: the ledger's two keys.
_KEYS = """
local z, h = KEYS[1], KEYS[2]
"""
# The server's clock in ms: every sidecar's script reads the one clock.
_NOW = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
"""
_READ_TOTAL = f"""
local total = tonumber(redis.call('HGET', h, '{_TOTAL}') or '0')
"""


def _expired(limit_arg: int, purge: bool) -> str:
    """Lua: the members expired by ``now`` (at most ARGV[limit_arg]) taken off
    ``total``, and (``purge``) out of the ledger."""
    out = f"""
local gone = redis.call('ZRANGEBYSCORE', z, '-inf', now, 'LIMIT', 0, tonumber(ARGV[{limit_arg}]))
if #gone > 0 then
  local sizes = redis.call('HMGET', h, unpack(gone))
  for i = 1, #gone do total = total - (tonumber(sizes[i]) or 0) end
"""
    if purge:
        out += """  redis.call('ZREM', z, unpack(gone))
  redis.call('HDEL', h, unpack(gone))
"""
    return out + "end\n"


# KEYS: expiry set, bytes hash. ARGV: budget, purge limit, then per object
# name, bytes, ttl (ms). Answers one of REFUSED / RESERVED / HELD per object.
_RESERVE = (
    _KEYS
    + """
if redis.call('EXISTS', z) ~= redis.call('EXISTS', h) then
  redis.call('DEL', z, h)
end
"""
    + _NOW
    + _READ_TOTAL
    + _expired(2, purge=True)
    + """
local budget = tonumber(ARGV[1])
local answers = {}
for i = 3, #ARGV, 3 do
  local name, size, ttl = ARGV[i], tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2])
  if redis.call('ZSCORE', z, name) then
    answers[#answers + 1] = 2
  elseif total + size > budget then
    answers[#answers + 1] = 0
  else
    redis.call('ZADD', z, string.format('%d', now + ttl), name)
    redis.call('HSET', h, name, size)
    total = total + size
    answers[#answers + 1] = 1
  end
end
"""
    + _FINISH
    + """
return answers
"""
)

# KEYS: expiry set, bytes hash. ARGV: names whose reservations end unstored.
_GIVE_BACK = (
    _KEYS
    + _READ_TOTAL
    + """
for i = 1, #ARGV do
  if redis.call('ZREM', z, ARGV[i]) == 1 then
    total = total - (tonumber(redis.call('HGET', h, ARGV[i])) or 0)
    redis.call('HDEL', h, ARGV[i])
  end
end
"""
    + _FINISH
    + """
return total
"""
)

# KEYS: expiry set, bytes hash. ARGV: the limit of members read. Answers the
# bytes the ledger counts now: its total less its members already expired
# (read only; the next reserve purges them).
_USAGE = (
    _KEYS
    + _NOW
    + _READ_TOTAL
    + _expired(1, purge=False)
    + """
if total < 0 then total = 0 end
return string.format('%d', total)
"""
)


class NotStored(Exception):
    """A store the ledger kept from the server: ``budget`` (refused, counted
    per tenant) or ``held`` (another writer holds the object's reservation
    and it is not there yet). Not a failure of the tier."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class SharedBudgets:
    """The tenants' shared-tier budgets of one key prefix (module docstring).
    Thread-safe: the server orders the scripts; a lock guards the counts."""

    def __init__(self, key_prefix: str, budgets: Mapping[str, int]) -> None:
        """``budgets``: bytes per tenant that has a shared budget (> 0; a
        budget of 0 never reaches the tier: write-behind keeps it out)."""
        self._prefix = key_prefix
        self.budgets = {tenant: n for tenant, n in budgets.items() if n > 0}
        self._scripts: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._refusals: Counter[tuple[str, str]] = Counter()

    def __bool__(self) -> bool:
        return bool(self.budgets)

    def keys(self, tenant: str) -> tuple[str, str]:
        """The ledger's two keys for ``tenant`` (expiry set, bytes hash)."""
        # Everything before the first "}" is the same in both keys, so the
        # server finds one hash tag in them whatever the prefix holds.
        base = f"{self._prefix}budget:{{{tenant}}}"
        return f"{base}:expiry", f"{base}:bytes"

    def reserve(
        self,
        client: Any,
        tenants: Sequence[str],
        names: Sequence[str],
        sizes: Sequence[int],
        expiry_ms: Sequence[int | None],
    ) -> list[int]:
        """For each object, RESERVED, REFUSED, HELD or UNBUDGETED (one script
        call per budgeted tenant in the batch). Refusals are counted here;
        any error of the server or the connection is raised."""
        answers = [UNBUDGETED] * len(names)
        reserve = self._script(client, "reserve")
        try:
            for tenant, indices in self._by_tenant(tenants).items():
                args: list[Any] = [self.budgets[tenant], PURGE_AT_ONCE]
                for i in indices:  # every budgeted tenant has an expiry: ValkeyTier refuses others
                    args += [names[i], sizes[i], expiry_ms[i]]
                replies = reserve(keys=self.keys(tenant), args=args, client=client)
                if len(replies) != len(indices):
                    raise ValueError(f"budget ledger answered {len(replies)} of {len(indices)}")
                for i, reply in zip(indices, replies, strict=True):
                    answers[i] = int(reply)
                refused = sum(1 for i in indices if answers[i] == REFUSED)
                if refused:
                    with self._lock:
                        self._refusals[(tenant, "budget")] += refused
        except Exception:
            # The batch is not sent: what the tenants before the failing one
            # reserved goes back now, rather than shrink their budgets until
            # it expires (still so when the server cannot be reached at all).
            self._give_back_reserved(client, tenants, names, answers)
            raise
        return answers

    def _give_back_reserved(
        self, client: Any, tenants: Sequence[str], names: Sequence[str], answers: Sequence[int]
    ) -> None:
        back = [i for i, answer in enumerate(answers) if answer == RESERVED]
        if not back:
            return
        with contextlib.suppress(Exception):  # unreachable: counted until they expire
            self.give_back(client, [tenants[i] for i in back], [names[i] for i in back])

    def give_back(self, client: Any, tenants: Sequence[str], names: Sequence[str]) -> None:
        """End the reservations of ``names`` (objects that were not stored);
        raises on any error (the ledger then counts them until they expire)."""
        give_back = self._script(client, "give_back")
        for tenant, indices in self._by_tenant(tenants).items():
            give_back(keys=self.keys(tenant), args=[names[i] for i in indices], client=client)

    def usage(self, client: Any) -> dict[str, int]:
        """Bytes each budgeted tenant's ledger counts now (0 for one with no
        ledger); raises on any error."""
        usage = self._script(client, "usage")
        return {
            tenant: int(usage(keys=self.keys(tenant), args=[PURGE_AT_ONCE], client=client))
            for tenant in self.budgets
        }

    def figures(self, usage: Mapping[str, int] | None = None) -> TenantFigures:
        """Refusals per (tenant, reason), with ``usage`` (:meth:`usage`) as
        what the tenants hold."""
        with self._lock:
            return TenantFigures(dict(usage or {}), dict(self._refusals), {})

    def _by_tenant(self, tenants: Sequence[str]) -> dict[str, list[int]]:
        """Indices of the objects of each budgeted tenant."""
        groups: defaultdict[str, list[int]] = defaultdict(list)
        for i, tenant in enumerate(tenants):
            if tenant in self.budgets:
                groups[tenant].append(i)
        return groups

    def _script(self, client: Any, name: str) -> Any:
        """One of the scripts (called with EVALSHA on the client each call names,
        loaded again on a NOSCRIPT reply: a restarted server has forgotten them)."""
        script = self._scripts.get(name)
        if script is None:
            source = {"reserve": _RESERVE, "give_back": _GIVE_BACK, "usage": _USAGE}[name]
            script = self._scripts[name] = client.register_script(source)
        return script
