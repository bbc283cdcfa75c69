"""The encryption keys of one KVCache: a Secret the operator creates and rotates.

Why this module exists: keys must outlive any one pod, reach every sidecar
of the KVCache and change on a schedule without a miss storm; the Secret
``NAME-keys`` holds them, and these plain functions decide its next content
from its current one and the clock (tests drive them without a cluster).

The Secret's data (each value base64, as Secret data is)::

    data:
      k20260101000000.key: <32 random bytes>     # one file per key
      k20260131000000.key: <32 random bytes>
      keyring.json: |                            # what the sidecar reads: "writing";
        {"writing": "k20260101000000",           # the rest is this module's bookkeeping
         "keys": {"k20260101000000": {"created": "2026-01-01T00:00:00Z", "retired": null},
                  "k20260131000000": {"created": "2026-01-31T00:00:00Z", "retired": null}}}

The sidecar mounts the whole Secret (no ``items``, so new keys appear) read
only at :data:`KEY_DIR` and re-reads it when the kubelet swaps it.

Rotation is two passes apart, so no sidecar is asked to read a key it has
not yet received: a pass that finds the writing key older than
``rotateEvery`` adds a new key for reading only (the example above); a pass
at least :data:`PROPAGATION_SECONDS` later (the kubelet's sync period plus
its cache, so every pod has the file by then) makes it the writing key and
marks the old one retired. A retired key is pruned once every object it
sealed has expired: after :func:`retention_seconds` (the longest expiry of
the KVCache's shared tier, and never less than ``rotateEvery``). An object
that outlives its key (L2 files and shared objects without an expiry) is then
a counted miss (``unknown_key``), never an error.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

from kvstrata.operator import names
from kvstrata.operator import spec as S
from kvstrata.operator.model import KVCache, SpecError
from kvstrata.operator.resources import secret_metadata

KEY_DIR = S.ENCRYPTION_KEY_DIR
INDEX_FILE = "keyring.json"  # the sidecar's kvstrata.sidecar.sealing.INDEX_FILE
KEY_SUFFIX = ".key"
KEY_BYTES = 32
# kubelet syncPeriod (60 s) + its Secret cache TTL (60 s), with a margin.
PROPAGATION_SECONDS = 180.0
_DURATION = re.compile(r"^([1-9][0-9]*)(s|m|h|d)$")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_TIME_FORMAT = "%Y-%m-%dT%H:%M:%SZ"

NewKey = Callable[[], bytes]


def keys_secret_name(name: str) -> str:
    return names.child_name(name, "keys")


def parse_duration(value: str, field: str) -> float:
    """Seconds of ``720h``-style ``value``; :class:`SpecError` naming ``field``."""
    match = _DURATION.match(value)
    if match is None:
        raise SpecError(f"{field}: {value!r} is not a duration such as 720h or 30d")
    return float(int(match.group(1)) * _UNIT_SECONDS[match.group(2)])


def retention_seconds(kvcache: KVCache) -> float:
    """How long a retired key stays readable: until the last object it sealed
    has expired in the shared tier, and at least one rotation period."""
    spec = kvcache.spec
    rotate = spec.encryption.rotate_every
    floor = parse_duration(rotate, "spec.encryption.rotateEvery") if rotate else 0.0
    expiries = [floor, PROPAGATION_SECONDS]
    ttl = spec.shared.valkey_or_default.ttl_seconds
    if spec.shared.backend == "valkey" and ttl:
        expiries.append(float(ttl))
    days = spec.shared.s3_or_default.expiry_days
    if spec.shared.backend == "s3" and days:
        expiries.append(days * 86400.0)
    return max(expiries)


def _stamp(moment: dt.datetime) -> str:
    return moment.strftime(_TIME_FORMAT)


def _parse_stamp(text: str) -> dt.datetime:
    return dt.datetime.strptime(text, _TIME_FORMAT).replace(tzinfo=dt.timezone.utc)


def _new_key_id(now: dt.datetime, taken: Mapping[str, Any]) -> str:
    base = "k" + now.strftime("%Y%m%d%H%M%S")
    key_id, n = base, 1
    while key_id in taken:
        key_id, n = f"{base}-{n}", n + 1
    return key_id


def read_keyring(secret: Mapping[str, Any] | None) -> tuple[dict[str, Any], dict[str, bytes]]:
    """(bookkeeping, key material by id) of an existing keys Secret; empty when
    there is none or its index does not parse (the next pass then starts over)."""
    data = (secret or {}).get("data") or {}
    try:
        index = json.loads(base64.b64decode(data[INDEX_FILE]))
        keys = {key_id: base64.b64decode(data[f"{key_id}{KEY_SUFFIX}"]) for key_id in index["keys"]}
        _parse_stamp(index["keys"][index["writing"]]["created"])
    except (KeyError, ValueError, TypeError):
        return {}, {}
    return index, keys


def next_keyring(
    index: Mapping[str, Any],
    keys: Mapping[str, bytes],
    now: dt.datetime,
    rotate_every: float | None,
    retain_for: float,
    new_key: NewKey = lambda: os.urandom(KEY_BYTES),
) -> tuple[dict[str, Any], dict[str, bytes], list[str]]:
    """The keyring one pass at ``now`` leaves: (index, keys, what changed, for Events).

    See the module docstring: create, stage, promote, prune, in that order.
    """
    if not keys or not index:
        key_id = _new_key_id(now, {})
        entry = {"created": _stamp(now), "retired": None}
        return (
            {"writing": key_id, "keys": {key_id: entry}},
            {key_id: new_key()},
            [f"created encryption key {key_id}"],
        )
    out_index: dict[str, Any] = {
        "writing": index["writing"],
        "keys": {k: dict(v) for k, v in index["keys"].items()},
    }
    out_keys = dict(keys)
    changes: list[str] = []
    entries = out_index["keys"]
    writing = out_index["writing"]
    staged = [
        k
        for k, v in entries.items()
        if k != writing and v["retired"] is None and v["created"] >= entries[writing]["created"]
    ]
    if staged:
        newest = max(staged, key=lambda k: entries[k]["created"])
        if (now - _parse_stamp(entries[newest]["created"])).total_seconds() >= PROPAGATION_SECONDS:
            entries[writing]["retired"] = _stamp(now)
            out_index["writing"] = newest
            changes.append(f"encryption key {newest} now writes; {writing} kept for reading")
    elif rotate_every is not None:
        age = (now - _parse_stamp(entries[writing]["created"])).total_seconds()
        if age >= rotate_every:
            key_id = _new_key_id(now, entries)
            entries[key_id] = {"created": _stamp(now), "retired": None}
            out_keys[key_id] = new_key()
            changes.append(f"added encryption key {key_id}, writing once every pod has it")
    for key_id, entry in list(entries.items()):
        retired = entry["retired"]
        if retired and (now - _parse_stamp(retired)).total_seconds() >= retain_for:
            del entries[key_id]
            out_keys.pop(key_id, None)
            changes.append(f"pruned encryption key {key_id}: its objects have expired")
    return out_index, out_keys, changes


def secret_data(index: Mapping[str, Any], keys: Mapping[str, bytes]) -> dict[str, str]:
    """The Secret's ``data``: the index and one file per key, base64."""
    data = {f"{k}{KEY_SUFFIX}": base64.b64encode(v).decode() for k, v in sorted(keys.items())}
    data[INDEX_FILE] = base64.b64encode(json.dumps(index, sort_keys=True).encode()).decode()
    return data


def desired_keys_secret(
    kvcache: KVCache,
    existing: Mapping[str, Any] | None,
    now: dt.datetime,
    new_key: NewKey = lambda: os.urandom(KEY_BYTES),
) -> tuple[dict[str, Any] | None, list[str]]:
    """The keys Secret this pass applies (None when encryption is off) and what changed."""
    encryption = kvcache.spec.encryption
    if encryption.mode == "off":
        return None, []
    rotate = encryption.rotate_every
    rotate_every = parse_duration(rotate, "spec.encryption.rotateEvery") if rotate else None
    index, keys = read_keyring(existing)
    index, keys, changes = next_keyring(
        index, keys, now, rotate_every, retention_seconds(kvcache), new_key
    )
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": secret_metadata(kvcache, keys_secret_name(kvcache.name), "encryption"),
        "type": "Opaque",
        "data": secret_data(index, keys),
    }
    return secret, changes
