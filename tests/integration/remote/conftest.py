"""Real servers for the shared-tier tests, started by fixtures.

* ``valkey_server``: one ``valkey-server``/``redis-server`` on a free
  loopback port (session-wide; fault tests start their own).
* ``valkey_cluster``: three cluster-enabled servers joined with
  ``redis-cli --cluster create`` (session-wide).
* ``moto_s3``: moto's standalone S3 server in a child process (session-wide).

Launch code lives in :mod:`kvstrata.testing.servers`, shared with
``kvstrata bench remote``. Each test gets its own key prefix, so tests on
the shared servers never see each other's objects.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import pytest
import redis
import redis.cluster

from kvstrata.sidecar.config import SharedConfig
from kvstrata.sidecar.keys import ChunkKey, key_hex
from kvstrata.sidecar.sealing import KeyRing
from kvstrata.sidecar.tiers.base import Tier
from kvstrata.sidecar.tiers.disk import DiskTier
from kvstrata.sidecar.tiers.factory import build_shared_tier
from kvstrata.sidecar.tiers.s3 import S3Tier
from kvstrata.testing.faults import FaultyLink
from kvstrata.testing.servers import (
    LOOPBACK,
    MotoS3Server,
    RedisClusterServers,
    RedisServer,
    ServerError,
    redis_server_binary,
)

BACKENDS = ["valkey", "valkey-cluster", "s3"]


def _require_redis_binary() -> None:
    try:
        redis_server_binary()
    except ServerError as exc:
        pytest.fail(f"{exc}; run `make system-deps`")


@pytest.fixture(scope="session")
def valkey_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    _require_redis_binary()
    with RedisServer(tmp_path_factory.mktemp("valkey")) as server:
        yield server


@pytest.fixture(scope="session")
def valkey_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterServers]:
    _require_redis_binary()
    with RedisClusterServers(tmp_path_factory.mktemp("valkey-cluster")) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def s3_credentials(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Mounted-secret style credential files (moto accepts any keys)."""
    base = tmp_path_factory.mktemp("s3-secrets")
    (base / "access_key_id").write_text("kvstrata-test\n")
    (base / "secret_access_key").write_text("kvstrata-secret\n")
    return {
        "access_key_id_file": str(base / "access_key_id"),
        "secret_access_key_file": str(base / "secret_access_key"),
    }


@pytest.fixture(scope="session")
def moto_s3() -> Iterator[MotoS3Server]:
    with MotoS3Server() as server:
        yield server


@pytest.fixture
def moto_s3_raw(moto_s3: MotoS3Server) -> Iterator[Any]:
    """boto3's own client on the session's S3 endpoint, to inspect objects."""
    client = raw_s3_client(moto_s3.endpoint_url)
    yield client
    client.close()


def raw_s3_client(endpoint_url: str) -> Any:
    """A plain boto3 client with the keys of ``s3_credentials`` (moto takes any)."""
    return boto3.client(
        "s3",
        endpoint_url=endpoint_url,
        region_name="us-east-1",
        aws_access_key_id="kvstrata-test",
        aws_secret_access_key="kvstrata-secret",
    )


def unique_prefix() -> str:
    return f"t{uuid.uuid4().hex[:12]}:"


# What these tests check is what a tier holds, not how fast it answers: the
# default 50 ms lookup deadline would turn a present object into a miss on a
# loaded machine. Tests of the deadline itself set their own.
CONTRACT_LOOKUP_TIMEOUT_S = 30.0


def valkey_shared_config(url: str, cluster: bool = False, **overrides: Any) -> SharedConfig:
    overrides.setdefault("lookup_timeout_seconds", CONTRACT_LOOKUP_TIMEOUT_S)
    valkey = {"url": url, "cluster": cluster, "key_prefix": unique_prefix()}
    valkey.update(overrides.pop("valkey", {}))
    return SharedConfig(backend="valkey", valkey=valkey, **overrides)


def s3_shared_config(
    endpoint_url: str, credentials: dict[str, str], **overrides: Any
) -> SharedConfig:
    overrides.setdefault("lookup_timeout_seconds", CONTRACT_LOOKUP_TIMEOUT_S)
    s3 = {
        "endpoint_url": endpoint_url,
        "bucket": "kvstrata-test",
        "prefix": unique_prefix().replace(":", "/"),
        "create_bucket": True,
        **credentials,
    }
    s3.update(overrides.pop("s3", {}))
    return SharedConfig(backend="s3", s3=s3, **overrides)


@dataclass
class RawStore:
    """The backend's own client, for tampering with stored objects."""

    name_of: Callable[[ChunkKey], str]
    read: Callable[[str], bytes | None]
    write: Callable[[str, bytes], None]


@dataclass
class Backend:
    """One backend under test: build tiers on it, reach its objects raw.

    ``make_config`` is None for the local disk tier (it has no shared config).
    """

    kind: str
    tier_name: str
    build: Callable[..., tuple[Tier, RawStore]]
    make_config: Callable[..., SharedConfig] | None
    tiers: list[Tier]

    def make_tier(self, **overrides: Any) -> tuple[Tier, RawStore]:
        tier, raw = self.build(**overrides)
        self.tiers.append(tier)
        return tier, raw


def _shared_builder(
    make_config: Callable[..., SharedConfig], raw_for: Callable[[SharedConfig], RawStore]
) -> Callable[..., tuple[Tier, RawStore]]:
    def build(keys: KeyRing | None = None, **overrides: Any) -> tuple[Tier, RawStore]:
        config = make_config(**overrides)
        tier = build_shared_tier(config, keys=keys)
        assert tier is not None
        return tier, raw_for(config)

    return build


def _redis_raw(client: Any, config: SharedConfig) -> RawStore:
    prefix = config.valkey.key_prefix
    return RawStore(
        name_of=lambda key: prefix + key_hex(key),
        read=client.get,
        write=lambda name, data: client.set(name, data),
    )


def _s3_raw(client: Any, config: SharedConfig) -> RawStore:
    s3 = config.s3

    def read(name: str) -> bytes | None:
        try:
            return client.get_object(Bucket=s3.bucket, Key=name)["Body"].read()
        except client.exceptions.NoSuchKey:
            return None

    return RawStore(
        name_of=lambda key: s3.prefix + key_hex(key),
        read=read,
        write=lambda name, data: client.put_object(Bucket=s3.bucket, Key=name, Body=data),
    )


def _file_raw(tier: DiskTier) -> RawStore:
    def read(path: str) -> bytes | None:
        try:
            return Path(path).read_bytes()
        except FileNotFoundError:
            return None

    def write(path: str, data: bytes) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_bytes(data)

    return RawStore(name_of=tier.path_of, read=read, write=write)


def _disk_backend(base: Path) -> Backend:
    def build(
        keys: KeyRing | None = None, root: Path | None = None, **_: Any
    ) -> tuple[Tier, RawStore]:
        # Shared-tier settings do not apply to the disk tier; its keys and
        # folder (``root``: tiers on one folder see each other's files) do.
        where = root if root is not None else base / uuid.uuid4().hex[:8]
        tier = DiskTier(where, capacity_bytes=256 << 20, keys=keys)
        return tier, _file_raw(tier)

    return Backend("disk", "l2", build, None, [])


def _shared_backend(request: pytest.FixtureRequest, kind: str) -> tuple[Backend, Any]:
    """A backend on the session's real servers, and its raw client (to close)."""
    if kind == "s3":
        moto: MotoS3Server = request.getfixturevalue("moto_s3")
        creds: dict[str, str] = request.getfixturevalue("s3_credentials")
        raw_client = raw_s3_client(moto.endpoint_url)

        def make_config(**o: Any) -> SharedConfig:
            return s3_shared_config(moto.endpoint_url, creds, **o)

        raw_for: Callable[[SharedConfig], RawStore] = lambda cfg: _s3_raw(raw_client, cfg)  # noqa: E731
    elif kind == "valkey":
        server: RedisServer = request.getfixturevalue("valkey_server")
        raw_client = redis.Redis(host=LOOPBACK, port=server.port)

        def make_config(**o: Any) -> SharedConfig:
            return valkey_shared_config(server.url, **o)

        raw_for = lambda cfg: _redis_raw(raw_client, cfg)  # noqa: E731
    else:
        cluster: RedisClusterServers = request.getfixturevalue("valkey_cluster")
        raw_client = redis.cluster.RedisCluster(host=LOOPBACK, port=cluster.servers[0].port)

        def make_config(**o: Any) -> SharedConfig:
            return valkey_shared_config(cluster.url, cluster=True, **o)

        raw_for = lambda cfg: _redis_raw(raw_client, cfg)  # noqa: E731
    name = "s3" if kind == "s3" else "valkey"
    return Backend(kind, name, _shared_builder(make_config, raw_for), make_config, []), raw_client


def _close_backend(backend: Backend, raw_client: Any) -> None:
    for tier in backend.tiers:
        tier.clear()
        tier.close()
    if raw_client is not None:
        raw_client.close()


@pytest.fixture(params=[*BACKENDS, "disk"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    """Every tier below L1 in turn: the shared ones on real servers, and L2 on disk."""
    if request.param == "disk":
        b, raw_client = _disk_backend(tmp_path), None
    else:
        b, raw_client = _shared_backend(request, request.param)
    yield b
    _close_backend(b, raw_client)


@pytest.fixture(params=BACKENDS)
def shared_backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    """Every shared (L3) backend in turn, on the session's real servers."""
    b, raw_client = _shared_backend(request, request.param)
    yield b
    _close_backend(b, raw_client)


@pytest.fixture
def stalling_proxy_to() -> Iterator[Callable[[int], FaultyLink]]:
    """A :class:`~kvstrata.testing.faults.FaultyLink` to a port: the one
    fault moto cannot produce is a hung endpoint."""
    proxies: list[FaultyLink] = []

    def make(upstream_port: int) -> FaultyLink:
        proxy = FaultyLink(upstream_port)
        proxies.append(proxy)
        return proxy

    yield make
    for proxy in proxies:
        proxy.close()


@pytest.fixture
def own_valkey_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A server this test may kill and restart."""
    _require_redis_binary()
    with RedisServer(tmp_path / "valkey") as server:
        yield server


@pytest.fixture
def own_moto_s3() -> Iterator[MotoS3Server]:
    """An S3 endpoint this test may stop and start again."""
    with MotoS3Server() as server:
        yield server


@pytest.fixture
def valkey_config() -> Callable[..., SharedConfig]:
    """``valkey_config(url, cluster=False, **shared_overrides)`` with a fresh key prefix."""
    return valkey_shared_config


@pytest.fixture
def s3_tiers(moto_s3: MotoS3Server, s3_config) -> Iterator[Callable[..., S3Tier]]:
    """``s3_tiers(endpoint_url=None, s3={...}, **shared_overrides)``: S3 tiers
    on one prefix (by default on the session's moto), closed after the test."""
    made: list[S3Tier] = []
    prefix = s3_config(moto_s3.endpoint_url).s3.prefix

    def make(endpoint_url: str | None = None, **overrides: Any) -> S3Tier:
        s3 = {"prefix": prefix, **overrides.pop("s3", {})}
        config = s3_config(endpoint_url or moto_s3.endpoint_url, s3=s3, **overrides)
        tier = build_shared_tier(config)
        assert isinstance(tier, S3Tier)
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.close()


@pytest.fixture
def s3_config(s3_credentials: dict[str, str]) -> Callable[..., SharedConfig]:
    """``s3_config(endpoint_url, **shared_overrides)`` with a fresh prefix and credentials."""
    return lambda endpoint_url, **o: s3_shared_config(endpoint_url, s3_credentials, **o)
