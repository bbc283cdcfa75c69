"""The S3 tier's client: how it is made, the bucket-level calls, and what its errors mean.

Why a module of its own: :class:`~kvstrata.sidecar.tiers.s3.S3Tier` decides
when to call S3 (deadlines, the breaker, lookups, fetches); what one call
is, as a plain function of a boto3 client, and how a failure is named in
``kvstrata_tier_errors_total`` are the same for the tier and for the
benchmarks' raw baseline, which builds its client here too.

Error kinds (:func:`error_kind`): ``deadline`` (the tier's own wall-clock
deadline passed), ``timeout``, ``connection``, ``auth``, ``server`` (any
other error reply), ``client`` (anything else). A 404 is no error: a miss
(:func:`is_missing`).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
from collections.abc import Sequence
from typing import Any

import boto3
import botocore.config
import botocore.exceptions

from kvstrata.sidecar.config import S3Config
from kvstrata.sidecar.tiers.remote import read_secret
from kvstrata.sidecar.tiers.s3ahead import close_response

__all__ = [
    "DELETE_BATCH",
    "EXISTS_CODES",
    "MISSING_CODES",
    "DeadlineExceeded",
    "Missing",
    "botocore_config",
    "close_late",
    "copy_onto_itself",
    "delete_keys",
    "delete_prefix",
    "ensure_bucket",
    "error_code",
    "error_kind",
    "is_missing",
    "lookup_threads",
    "make_client",
]

logger = logging.getLogger("kvstrata.sidecar.tiers.s3")

DELETE_BATCH = 1000  # the most keys one DeleteObjects call takes
MISSING_CODES = frozenset({"404", "NoSuchKey", "NotFound"})
# A conditional PUT refused because the object exists (or is being written).
EXISTS_CODES = frozenset({"PreconditionFailed", "412", "ConditionalRequestConflict"})


class Missing(Exception):
    """The object (or bucket) is not there: a plain miss, not a failure."""


class DeadlineExceeded(Exception):
    """The operation did not finish within the tier's wall-clock deadline."""


def botocore_config(config: S3Config) -> botocore.config.Config:
    """The client settings the tier (and the benchmark's raw baseline) uses."""
    return botocore.config.Config(
        region_name=config.region,
        connect_timeout=config.timeout_seconds,
        read_timeout=config.timeout_seconds,
        retries={"max_attempts": config.max_attempts, "mode": "standard"},
        # Transfers, their multipart parts and the lookups' requests share one
        # pool; a lookup's GETs keep their connections while held (at most
        # lookup_threads of them, see S3Tier._held), so the transfers keep theirs.
        max_pool_connections=config.max_concurrency * 2 + lookup_threads(config),
        # Objects carry their own xxh3 checksums, verified on every read.
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )


def lookup_threads(config: S3Config) -> int:
    """A lookup's requests are small (HEADs, or GETs whose bodies it leaves for
    the fetches): a lookup sends many more at once than there are transfers."""
    return min(4 * config.max_concurrency, 64)


def make_client(config: S3Config) -> Any:
    """A boto3 S3 client: credentials from the mounted files, else boto3's chain."""
    credentials: dict[str, str] = {}
    if config.access_key_id_file or config.secret_access_key_file:
        if not (config.access_key_id_file and config.secret_access_key_file):
            raise ValueError(
                "shared.s3.access_key_id_file and shared.s3.secret_access_key_file "
                "must be set together"
            )
        credentials = {
            "aws_access_key_id": read_secret(
                config.access_key_id_file, "shared.s3.access_key_id_file"
            ),
            "aws_secret_access_key": read_secret(
                config.secret_access_key_file, "shared.s3.secret_access_key_file"
            ),
        }
    session = boto3.session.Session(**credentials)
    return session.client("s3", endpoint_url=config.endpoint_url, config=botocore_config(config))


def error_kind(exc: BaseException) -> str:
    """The kind a failure is counted as (module docstring)."""
    if isinstance(exc, DeadlineExceeded):
        return "deadline"
    if isinstance(
        exc, botocore.exceptions.ConnectTimeoutError | botocore.exceptions.ReadTimeoutError
    ):
        return "timeout"
    if isinstance(
        exc, botocore.exceptions.EndpointConnectionError | botocore.exceptions.ConnectionClosedError
    ):
        return "connection"
    if isinstance(exc, botocore.exceptions.NoCredentialsError):
        return "auth"
    if isinstance(exc, botocore.exceptions.ClientError):
        code = error_code(exc)
        return "auth" if code in ("AccessDenied", "403", "InvalidAccessKeyId") else "server"
    if isinstance(exc, botocore.exceptions.BotoCoreError):
        return "connection"
    # A body read straight off the socket (.s3body): its deadline or the
    # socket's timeout, or the connection ending early.
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, OSError):
        return "connection"
    return "client"


def error_code(exc: BaseException) -> str:
    """The S3 error code of an error reply ("" for any other failure)."""
    if isinstance(exc, botocore.exceptions.ClientError):
        return str(exc.response.get("Error", {}).get("Code", ""))
    return ""


def is_missing(exc: BaseException) -> bool:
    """Whether ``exc`` says the object (or bucket) is not there."""
    return error_code(exc) in MISSING_CODES


def close_late(future: cf.Future[Any]) -> None:
    """Close a GET response that came after its caller gave up (a done-callback)."""
    if not future.cancelled() and future.exception() is None:
        close_response(future.result())


def ensure_bucket(client: Any, bucket: str, region: str) -> None:
    """Create ``bucket`` unless it exists (another creator winning the race is fine)."""
    try:
        client.head_bucket(Bucket=bucket)
        return
    except botocore.exceptions.ClientError as exc:
        if not is_missing(exc):
            raise
    args: dict[str, Any] = {"Bucket": bucket}
    if region != "us-east-1":
        args["CreateBucketConfiguration"] = {"LocationConstraint": region}
    try:
        client.create_bucket(**args)
    except botocore.exceptions.ClientError as exc:
        code = exc.response.get("Error", {}).get("Code")
        if code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
            raise
    logger.info("created S3 bucket %s", bucket)


def delete_keys(client: Any, bucket: str, names: Sequence[str]) -> None:
    """One DeleteObjects call per :data:`DELETE_BATCH` names; absent objects are fine."""
    for i in range(0, len(names), DELETE_BATCH):
        batch = [{"Key": n} for n in names[i : i + DELETE_BATCH]]
        client.delete_objects(Bucket=bucket, Delete={"Objects": batch, "Quiet": True})


def delete_prefix(client: Any, bucket: str, prefix: str) -> None:
    """Delete every object under ``prefix`` (listed page by page)."""
    paginator = client.get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=bucket, Prefix=prefix):
        delete_keys(client, bucket, [o["Key"] for o in page.get("Contents", [])])


def copy_onto_itself(client: Any, bucket: str, object_key: str) -> None:
    """Same bytes, a fresh LastModified (see :mod:`.s3refresh`)."""
    client.copy_object(
        Bucket=bucket,
        Key=object_key,
        CopySource={"Bucket": bucket, "Key": object_key},
        MetadataDirective="REPLACE",
    )
