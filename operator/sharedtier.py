"""Reach the shared tier a KVCache names, from the operator.

Why: ``SharedTierReady`` should say whether the sidecars will find their
shared tier, and ``spec.shared.s3.createBucket`` asks the operator (not every
sidecar) to create the bucket. Each function returns ``(ok, reason, message)``
and never raises: an unreachable tier is a condition, not a crash.

The S3 prefix marker object ``<prefix>.kvstrata`` is written when the bucket
is ensured; its body is JSON ``{"kvcache": "NAMESPACE/NAME"}``. It proves
write access with the operator's credentials and marks the prefix as in use.
Then the prefix's bounds are applied (:mod:`~kvstrata.operator.s3bounds`:
the expiry rule, the size sweep). A bucket the sidecars can use but whose
bounds could not be applied (no permission to change its lifecycle, say) is
usable and degraded: ``ok`` with a reason in :data:`USABLE_BUT_DEGRADED`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from kvstrata.operator.s3bounds import Sweep, ensure_expiry, sweep

logger = logging.getLogger(__name__)


# Reasons of a usable shared tier that still needs attention (Degraded=True).
USABLE_BUT_DEGRADED = frozenset({"LifecycleNotApplied", "SweepFailed"})


@dataclass(frozen=True, slots=True)
class Probe:
    ok: bool
    reason: str
    message: str
    sweep: Sweep | None = None  # the S3 size sweep of this pass, when it ran


@dataclass(frozen=True, slots=True)
class S3Target:
    bucket: str
    prefix: str
    region: str
    endpoint: str | None
    access_key_id: str | None
    secret_access_key: str | None
    create_bucket: bool
    expiry_days: int | None = None
    max_size_bytes: int | None = None


def ping_valkey(url: str, password: str | None, timeout_s: float = 2.0) -> Probe:
    """PING an external Valkey (standalone or a cluster seed)."""
    import redis

    try:
        client = redis.Redis.from_url(
            url, password=password, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
        try:
            client.ping()
        finally:
            client.close()
    except Exception as exc:  # any failure is a condition, with its text
        logger.debug("valkey ping %s failed: %s", url, exc)
        return Probe(False, "ValkeyUnreachable", f"PING {url} failed: {exc}")
    return Probe(True, "ValkeyReachable", f"PING {url} answered")


def ensure_s3(target: S3Target, owner: str, timeout_s: float = 5.0) -> Probe:
    """Check (and with ``create_bucket``, create) the bucket, then write the prefix marker."""
    import boto3
    import botocore.config
    import botocore.exceptions

    config = botocore.config.Config(
        connect_timeout=timeout_s, read_timeout=timeout_s, retries={"max_attempts": 2}
    )
    client = boto3.client(
        "s3",
        endpoint_url=target.endpoint,
        region_name=target.region,
        aws_access_key_id=target.access_key_id,
        aws_secret_access_key=target.secret_access_key,
        config=config,
    )
    where = f"s3://{target.bucket}/{target.prefix}"
    marker = f"{target.prefix}.kvstrata"
    try:
        created = _ensure_bucket(client, target, botocore.exceptions.ClientError)
        client.put_object(
            Bucket=target.bucket,
            Key=marker,
            Body=json.dumps({"kvcache": owner}).encode(),
            ContentType="application/json",
        )
    except _BucketMissing:
        return Probe(
            False, "BucketMissing", f"{where}: bucket does not exist and createBucket is false"
        )
    except Exception as exc:
        logger.debug("s3 ensure %s failed: %s", where, exc)
        return Probe(False, "S3Unreachable", f"{where}: {exc}")
    ready = Probe(True, "BucketCreated" if created else "BucketReady", f"{where} is writable")
    return _bounded(client, target, owner, marker, ready, botocore.exceptions.ClientError)


def _bounded(
    client: Any, target: S3Target, owner: str, marker: str, ready: Probe, client_error: type
) -> Probe:
    """Apply the prefix's expiry rule and size cap; ``ready`` unless one of them failed."""
    where = f"s3://{target.bucket}/{target.prefix}"
    try:
        ensure_expiry(client, target.bucket, owner, target.prefix, target.expiry_days, client_error)
    except Exception as exc:  # AccessDenied, a bucket without lifecycle support, ...
        logger.debug("s3 lifecycle of %s failed: %s", where, exc)
        return Probe(
            True, "LifecycleNotApplied", f"{where} is writable; expiry rule not applied: {exc}"
        )
    if target.max_size_bytes is None:
        return ready
    try:
        swept = sweep(client, target.bucket, target.prefix, target.max_size_bytes, keep=marker)
    except Exception as exc:
        logger.debug("s3 sweep of %s failed: %s", where, exc)
        return Probe(True, "SweepFailed", f"{where} is writable; size sweep failed: {exc}")
    if swept.failed:
        message = f"{where} is writable; size sweep could not delete: {swept.failed}"
        return Probe(True, "SweepFailed", message, swept)
    message = (
        f"{ready.message}; {swept.bytes - swept.deleted_bytes} of {target.max_size_bytes} "
        f"bytes used ({swept.deleted_objects} objects swept)"
    )
    return Probe(True, ready.reason, message, swept)


class _BucketMissing(Exception):
    pass


def _ensure_bucket(client: Any, target: S3Target, client_error: type[Exception]) -> bool:
    try:
        client.head_bucket(Bucket=target.bucket)
        return False
    except client_error as exc:
        code = str(exc.response.get("Error", {}).get("Code", ""))  # type: ignore[attr-defined]
        if code not in ("404", "NoSuchBucket", "NotFound"):
            raise
    if not target.create_bucket:
        raise _BucketMissing
    kwargs: dict = {"Bucket": target.bucket}
    if target.region != "us-east-1":
        kwargs["CreateBucketConfiguration"] = {"LocationConstraint": target.region}
    client.create_bucket(**kwargs)
    return True
