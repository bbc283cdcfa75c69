"""The S3 tier keeps what is read and drops what is superseded, on a real S3 endpoint.

Expiry and the size sweeper (the operator's) go by an object's
``LastModified``; a read of an object past ``refresh_after_seconds`` copies it
onto itself in the background so its ``LastModified`` is new again. Days
cannot pass in a test, so the endpoint is moto's S3 served in this process
(:class:`~kvstrata.testing.servers.AgeableMotoS3`) and objects are made
older on the server (``age``) instead of waiting.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from kvstrata.sidecar.config import config_from_dict
from kvstrata.sidecar.engine import StorageManager
from kvstrata.sidecar.keys import Namespace, key_hex, make_key
from kvstrata.sidecar.objformat import ChunkMeta
from kvstrata.sidecar.tiers.factory import build_shared_tier
from kvstrata.sidecar.tiers.s3 import S3Tier
from kvstrata.testing.servers import AgeableMotoS3

from .conftest import raw_s3_client, s3_shared_config

NS = Namespace(model="s3-bounds").fingerprint()
META = ChunkMeta(dtype="uint8", shape=(4096,))
DAY = 86400.0


def key(i: int):
    return make_key(NS, i.to_bytes(32, "big"))


@pytest.fixture(scope="module")
def ageable_s3() -> Iterator[AgeableMotoS3]:
    with AgeableMotoS3() as server:
        yield server


@pytest.fixture
def raw(ageable_s3: AgeableMotoS3) -> Iterator[Any]:
    client = raw_s3_client(ageable_s3.endpoint_url)
    yield client
    client.close()


@pytest.fixture
def refreshing_tier(ageable_s3, s3_credentials) -> Iterator[S3Tier]:
    config = s3_shared_config(
        ageable_s3.endpoint_url, s3_credentials, s3={"refresh_after_seconds": DAY}
    )
    tier = build_shared_tier(config)
    assert isinstance(tier, S3Tier)
    yield tier
    tier.close()


def last_modified(raw: Any, tier: S3Tier, k) -> Any:
    config = tier._config
    return raw.head_object(Bucket=config.bucket, Key=config.prefix + key_hex(k))["LastModified"]


def test_a_read_of_an_object_past_the_refresh_age_makes_it_new_again(
    refreshing_tier: S3Tier, ageable_s3: AgeableMotoS3, raw: Any
) -> None:
    tier = refreshing_tier
    data = os.urandom(4096)
    assert tier.put(key(1), data, META)
    name = tier._config.prefix + key_hex(key(1))
    ageable_s3.age(tier._config.bucket, name, 3 * DAY)
    aged = last_modified(raw, tier, key(1))

    got = tier.get(key(1))
    assert got is not None and bytes(got.payload) == data
    assert tier.drain_refreshes(timeout=10)

    assert tier.stats().refreshed_total == 1
    assert (last_modified(raw, tier, key(1)) - aged).total_seconds() >= 3 * DAY - 60
    again = tier.get(key(1))  # the copy kept the bytes, and they still validate
    assert again is not None and bytes(again.payload) == data


def test_a_lookup_refreshes_an_old_object_and_a_young_one_is_left_alone(
    refreshing_tier: S3Tier, ageable_s3: AgeableMotoS3, raw: Any
) -> None:
    tier = refreshing_tier
    assert tier.put_many([(key(2), os.urandom(4096), META), (key(3), os.urandom(4096), META)])
    ageable_s3.age(tier._config.bucket, tier._config.prefix + key_hex(key(2)), 2 * DAY)
    aged = last_modified(raw, tier, key(2))
    young = last_modified(raw, tier, key(3))

    assert tier.contains_many([key(2), key(3)]) == [True, True]
    assert tier.get(key(3)) is not None
    assert tier.drain_refreshes(timeout=10)

    assert tier.stats().refreshed_total == 1
    assert last_modified(raw, tier, key(2)) > aged
    assert last_modified(raw, tier, key(3)) == young


def test_without_refresh_after_seconds_reads_never_copy(
    ageable_s3: AgeableMotoS3, s3_credentials, raw: Any
) -> None:
    tier = build_shared_tier(s3_shared_config(ageable_s3.endpoint_url, s3_credentials))
    assert isinstance(tier, S3Tier)
    try:
        assert tier.put(key(4), os.urandom(4096), META)
        ageable_s3.age(tier._config.bucket, tier._config.prefix + key_hex(key(4)), 30 * DAY)
        aged = last_modified(raw, tier, key(4))
        assert tier.get(key(4)) is not None
        assert tier.drain_refreshes(timeout=10)
        assert tier.stats().refreshed_total == 0
        assert last_modified(raw, tier, key(4)) == aged
    finally:
        tier.close()


def test_partials_superseded_by_a_stored_chunk_are_deleted_from_s3_once_it_is_written(
    ageable_s3: AgeableMotoS3, s3_credentials, raw: Any
) -> None:
    shared = s3_shared_config(ageable_s3.endpoint_url, s3_credentials)
    config = config_from_dict(
        {
            "l1": {"size_bytes": "4Mi", "pin_memory": False},
            "l2": {"enabled": False},
            "shared": shared.model_dump(),
        }
    )
    tier = build_shared_tier(config.shared)
    assert isinstance(tier, S3Tier)
    engine = StorageManager(config, shared_tier=tier)
    bucket, prefix = config.shared.s3.bucket, config.shared.s3.prefix
    # Partials another sidecar wrote: this engine never saw them.
    partials = [key(10), key(11)]
    unrelated = key(12)
    for k in [*partials, unrelated]:
        assert tier.put(k, os.urandom(1024), ChunkMeta("uint8", (1024,), blocks=1))
    try:
        full = key(20)
        slot = engine.reserve(full, 4096, META, owner="writer")
        assert slot is not None
        engine.supersede(slot, partials)
        assert engine.commit(slot)
        assert engine.flush(timeout=20)

        listed = raw.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
        names = {o["Key"] for o in listed}
        assert prefix + key_hex(full) in names
        assert not names & {prefix + key_hex(k) for k in partials}
        assert prefix + key_hex(unrelated) in names
        assert engine.stats().counters.partial_superseded_deleted_total == 2
    finally:
        engine.close()
