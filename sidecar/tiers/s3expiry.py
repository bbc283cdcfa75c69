"""Per-object expiry on S3, which has none of its own: a tenant's TTL
(``tenants[].ttl_seconds``) written into the object and checked on every
read.

Why a module of its own: S3 expires objects only by a bucket lifecycle rule,
one age for a whole prefix; a tenant's TTL is per object. The S3 tier writes
the moment an object stops being valid as user metadata and every read that
sees the response's headers (a lookup's HEAD or GET, a fetch's GET) treats an
object past it as absent, and deletes it. Nobody may read an object again,
so a bucket lifecycle rule stays the backstop that removes what no read
finds (docs/shared-tiers.md, docs/tenants.md).

What is stored, on each object of a tenant with a TTL::

    x-amz-meta-kvstrata-expires: <unix seconds, decimal>   (boto3: Metadata)

An object without it never expires here. A value that does not parse is
treated as expired: an object whose TTL cannot be checked is not served.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Any

__all__ = ["EXPIRES_KEY", "expired", "expiry_metadata", "has_expiry"]

# User metadata key (boto3 lowercases and strips the x-amz-meta- prefix).
EXPIRES_KEY = "kvstrata-expires"


def expiry_metadata(ttl_seconds: float | None, now: float | None = None) -> dict[str, str]:
    """The Metadata of an object that may live ``ttl_seconds`` (None: no TTL, {})."""
    if ttl_seconds is None:
        return {}
    at = (time.time() if now is None else now) + ttl_seconds
    return {EXPIRES_KEY: f"{at:.3f}"}


def expired(response: Mapping[str, Any], now: float | None = None) -> bool:
    """Whether a HEAD or GET ``response`` is of an object past its expiry."""
    value = (response.get("Metadata") or {}).get(EXPIRES_KEY)
    if value is None:
        return False
    try:
        at = float(value)
    except (TypeError, ValueError):
        return True
    if not math.isfinite(at):
        return True
    return (time.time() if now is None else now) >= at


def has_expiry(response: Mapping[str, Any]) -> bool:
    """Whether the object carries a TTL: it is never refreshed (tiers.s3refresh),
    since a copy onto itself would outlive the TTL (and drop the metadata)."""
    return EXPIRES_KEY in (response.get("Metadata") or {})
