"""The shared (L3) tier's sections of the sidecar's config: Valkey, S3 and what both share.

Why a module of its own: the shared tier's settings are a third of the
schema and are read by the tiers (:mod:`kvstrata.sidecar.tiers`) apart from
the rest; :mod:`.config` assembles them into
:class:`~kvstrata.sidecar.config.SidecarConfig` (``shared:``) and
re-exports them. Their fields, defaults and bounds are listed in the
generated ``docs/configuration.md``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kvstrata.sidecar.config_base import ByteSize, ConfigSection

__all__ = ["S3Config", "SharedConfig", "ValkeyConfig"]


class ValkeyConfig(ConfigSection):
    """A Valkey (or Redis-protocol) shared tier, single server or cluster."""

    url: str = Field("redis://127.0.0.1:6379/0", description="redis:// or rediss:// (TLS) URL")
    cluster: bool = Field(False, description="Valkey Cluster mode (hash slots, redirections)")
    username: str | None = Field(None, description="AUTH user (unset: the default user)")
    password_file: str | None = Field(None, description="file holding the AUTH password")
    tls_ca_file: str | None = Field(
        None, description="CA bundle that signs the server's TLS certificate"
    )
    tls_insecure_skip_verify: bool = Field(
        False, description="accept any TLS certificate: no verification"
    )
    ttl_seconds: int | None = Field(None, ge=1, description="expire objects after this long")
    key_prefix: str = Field(
        "kvstrata:", description="prefix of every key this sidecar writes and reads"
    )
    pool_size: int = Field(16, ge=1, description="connections in the pool")
    timeout_seconds: float = Field(0.5, gt=0, description="deadline of one call")


class S3Config(ConfigSection):
    """An S3 (or S3-compatible: MinIO, Ceph RGW) shared tier."""

    endpoint_url: str | None = Field(None, description="None means AWS' own endpoint")
    region: str = Field("us-east-1", description="the bucket's region")
    bucket: str = Field("kvstrata", description="bucket of the objects")
    prefix: str = Field("kvstrata/", description="prefix of every object key")
    create_bucket: bool = Field(False, description="create the bucket when it is missing")
    access_key_id_file: str | None = Field(None, description="else the default boto3 chain")
    secret_access_key_file: str | None = Field(None, description="file holding the secret key")
    max_concurrency: int = Field(8, ge=1, le=256, description="transfer threads")
    multipart_threshold_bytes: ByteSize = Field(
        16 << 20, description="objects from this size are uploaded in parts"
    )
    multipart_chunk_bytes: ByteSize = Field(8 << 20, description="size of one part")
    max_attempts: int = Field(3, ge=1, le=20, description="attempts of one call, retries included")
    timeout_seconds: float = Field(5.0, gt=0, description="total deadline of one operation")
    # Expiry and the size cap are the bucket's (a lifecycle rule, the operator's
    # sweeper); the sidecar only keeps the objects it reads young.
    refresh_after_seconds: float | None = Field(
        None,
        gt=0,
        description="copy an object onto itself when a read finds it older than this, so "
        "expiry and the LRU sweeper spare what is read (None: never)",
    )
    refresh_per_second: float = Field(
        10.0, gt=0, description="most refresh copies per second (background, never on a read)"
    )
    refresh_queue_depth: int = Field(
        1024, ge=1, description="refreshes waiting at most; more are dropped and counted"
    )


class SharedConfig(ConfigSection):
    """The shared (L3) tier: none, Valkey or S3."""

    backend: Literal["none", "valkey", "s3"] = Field("none", description="the shared tier, if any")
    valkey: ValkeyConfig = Field(default_factory=ValkeyConfig)
    s3: S3Config = Field(default_factory=S3Config)
    codec: Literal["none", "zstd", "lz4"] = Field("none", description="lossless object codec")
    admission: Literal["all", "reused"] = Field(
        "all", description="all: write every chunk; reused: only chunks hit at least once"
    )
    write_queue_depth: int = Field(64, ge=1, description="pending writes before drops (counted)")
    writer_threads: int = Field(4, ge=1, le=64, description="threads writing into the shared tier")
    lookup_timeout_seconds: float = Field(
        0.05, gt=0, description="deadline for existence checks during lookup"
    )
    breaker_failures: int = Field(5, ge=1, description="consecutive failures that open the breaker")
    breaker_reset_seconds: float = Field(10.0, gt=0, description="how long an open breaker skips")
