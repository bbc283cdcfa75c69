"""Keep a KVCache's S3 prefix bounded: an expiry rule and a size sweeper.

Why the operator does it: it already reaches the bucket with the KVCache's
credentials on every reconcile (about once a minute, the recheck timer), it
runs once per cluster, and it sees each KVCache once per pass. A sweeper in
the sidecars would need an election among them; one here needs nothing.

Expiry (``spec.shared.s3.expiryDays``): one lifecycle rule per KVCache,
recognised by its ID, merged into the bucket's lifecycle configuration
without touching the rules of anything else::

    - ID: "kvstrata:NAMESPACE/NAME"
      Filter: {Prefix: "<the KVCache's prefix>"}
      Status: Enabled
      Expiration: {Days: <expiryDays>}
      AbortIncompleteMultipartUpload: {DaysAfterInitiation: 1}

The configuration is read, changed and written back only when this rule is
missing or different (removing ``expiryDays`` removes the rule). Two
operators writing the same bucket at once can lose one's change; the next
pass puts it back. S3 counts the days from an object's last write, which the
sidecars' refresh keeps recent for the objects they read
(:mod:`kvstrata.sidecar.tiers.s3refresh`).

Size cap (``spec.shared.s3.maxSize``): each pass lists the prefix and, when
its objects hold more bytes than the cap, deletes the ones with the oldest
``LastModified`` (a refreshed object counts as recent) until they fit.
Cost: one LIST request per 1000 objects per pass, and one DeleteObjects per
1000 deleted. The prefix marker object is never deleted.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

RULE_ID_PREFIX = "kvstrata:"
ABORT_MULTIPART_DAYS = 1  # parts of an upload that never finished are billed too
_DELETE_BATCH = 1000  # the most keys one DeleteObjects call takes


def rule_id(owner: str) -> str:
    """The lifecycle rule ID of the KVCache ``owner`` (``NAMESPACE/NAME``)."""
    return RULE_ID_PREFIX + owner


def expiry_rule(owner: str, prefix: str, days: int) -> dict[str, Any]:
    return {
        "ID": rule_id(owner),
        "Filter": {"Prefix": prefix},
        "Status": "Enabled",
        "Expiration": {"Days": days},
        "AbortIncompleteMultipartUpload": {"DaysAfterInitiation": ABORT_MULTIPART_DAYS},
    }


def _is_current(rule: dict[str, Any], prefix: str, days: int) -> bool:
    """Does a rule read back from the bucket say what :func:`expiry_rule` says?"""
    return (
        rule.get("Status") == "Enabled"
        and (rule.get("Filter") or {}).get("Prefix", rule.get("Prefix")) == prefix
        and (rule.get("Expiration") or {}).get("Days") == days
        and (rule.get("AbortIncompleteMultipartUpload") or {}).get("DaysAfterInitiation")
        == ABORT_MULTIPART_DAYS
    )


def merged_rules(
    existing: Sequence[dict[str, Any]], owner: str, prefix: str, days: int | None
) -> list[dict[str, Any]] | None:
    """The bucket's rules with this KVCache's rule set to ``days`` (None: removed).

    None when nothing needs to change. Rules of other IDs are kept as read.
    """
    mine = [r for r in existing if r.get("ID") == rule_id(owner)]
    others = [r for r in existing if r.get("ID") != rule_id(owner)]
    if days is None:
        return others if mine else None
    if len(mine) == 1 and _is_current(mine[0], prefix, days):
        return None
    return [*others, expiry_rule(owner, prefix, days)]


def ensure_expiry(
    client: Any, bucket: str, owner: str, prefix: str, days: int | None, client_error: type
) -> bool:
    """Make the bucket's lifecycle hold this KVCache's rule as wanted; True if changed.

    Raises the client's error (AccessDenied, ...) for the caller to report.
    """
    try:
        existing = client.get_bucket_lifecycle_configuration(Bucket=bucket).get("Rules", [])
    except client_error as exc:
        if _code(exc) != "NoSuchLifecycleConfiguration":
            raise
        existing = []
    rules = merged_rules(existing, owner, prefix, days)
    if rules is None:
        return False
    if rules:
        client.put_bucket_lifecycle_configuration(
            Bucket=bucket, LifecycleConfiguration={"Rules": rules}
        )
    else:
        client.delete_bucket_lifecycle(Bucket=bucket)
    return True


@dataclass(frozen=True, slots=True)
class StoredObject:
    key: str
    size: int
    last_modified: dt.datetime


@dataclass(frozen=True, slots=True)
class Sweep:
    """One sweep of a prefix: what it found, and what it deleted to fit the cap."""

    objects: int
    bytes: int
    deleted_objects: int
    deleted_bytes: int
    failed: str = ""  # the first per-key error DeleteObjects reported ("": none)


def victims(objects: Sequence[StoredObject], cap_bytes: int) -> list[StoredObject]:
    """The least recently modified objects to delete so the rest fit in ``cap_bytes``.

    Oldest first; equal times in key order, so two sweeps agree.
    """
    total = sum(o.size for o in objects)
    out: list[StoredObject] = []
    for obj in sorted(objects, key=lambda o: (o.last_modified, o.key)):
        if total <= cap_bytes:
            break
        out.append(obj)
        total -= obj.size
    return out


def sweep(client: Any, bucket: str, prefix: str, cap_bytes: int, keep: str) -> Sweep:
    """List ``prefix``, delete the least recently modified objects past ``cap_bytes``.

    ``keep`` (the prefix marker) is neither counted nor deleted.
    """
    objects: list[StoredObject] = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for item in page.get("Contents", []):
            if item["Key"] != keep:
                objects.append(StoredObject(item["Key"], item["Size"], item["LastModified"]))
    doomed = victims(objects, cap_bytes)
    refused: dict[str, str] = {}
    for i in range(0, len(doomed), _DELETE_BATCH):
        batch = [{"Key": o.key} for o in doomed[i : i + _DELETE_BATCH]]
        answer = client.delete_objects(Bucket=bucket, Delete={"Objects": batch, "Quiet": True})
        # A quiet DeleteObjects answers only the keys it could not delete.
        for error in answer.get("Errors", []):
            refused[error["Key"]] = f"{error.get('Code')}: {error.get('Message')}"
    deleted = [o for o in doomed if o.key not in refused]
    return Sweep(
        objects=len(objects),
        bytes=sum(o.size for o in objects),
        deleted_objects=len(deleted),
        deleted_bytes=sum(o.size for o in deleted),
        failed=next(iter(refused.values()), ""),
    )


def _code(exc: Any) -> str:
    return str(getattr(exc, "response", {}).get("Error", {}).get("Code", ""))
