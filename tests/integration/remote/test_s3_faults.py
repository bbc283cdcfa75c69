"""The S3 tier under faults: a stalled endpoint and a stopped one.

A stall is the one fault moto cannot produce, so a
:class:`~kvstrata.testing.faults.FaultyLink` sits between boto3 and the
real moto server and stops forwarding bytes. A stop is real: the moto
process is killed and a new one started on the same port (empty, so the
tier must make its bucket again).
"""

from __future__ import annotations

import os

import pytest

from kvstrata.sidecar.keys import Namespace, key_hex, make_key
from kvstrata.sidecar.objformat import ChunkMeta
from kvstrata.sidecar.tiers.factory import build_shared_tier
from kvstrata.sidecar.tiers.s3 import S3Tier
from kvstrata.testing.servers import MotoS3Server, wait_for

NS = Namespace(model="s3-faults").fingerprint()
META = ChunkMeta(dtype="uint8", shape=(4096,))
DEADLINE = 0.4


def key(i: int):
    return make_key(NS, i.to_bytes(32, "big"))


@pytest.fixture
def fast_failing(s3_config):
    def make(endpoint_url: str) -> S3Tier:
        config = s3_config(
            endpoint_url,
            breaker_failures=2,
            breaker_reset_seconds=0.2,
            lookup_timeout_seconds=0.1,
            s3={"timeout_seconds": DEADLINE, "max_attempts": 1},
        )
        tier = build_shared_tier(config)
        assert isinstance(tier, S3Tier)
        return tier

    return make


# How a call to a stalled or stopped endpoint may end: the tier's own
# deadline, botocore's read/connect timeout, a refused connection, or the
# open breaker (no network at all). A call that waited on the endpoint
# without a deadline would hang: pytest-timeout (well under botocore's
# default 60 s read timeout times three calls) ends the test then.
MISS_KINDS = {"deadline", "timeout", "connection", "breaker_open"}


def missed(tier: S3Tier, fn):
    """``fn()``'s result and the error kinds the tier counted for it."""
    before = dict(tier.stats().errors_total)
    result = fn()
    after = tier.stats().errors_total
    return result, {k for k, n in after.items() if n > before.get(k, 0)}


@pytest.mark.timeout(60)
def test_stalled_endpoint_answers_misses_within_the_deadline_and_recovers(
    moto_s3: MotoS3Server, stalling_proxy_to, fast_failing
) -> None:
    proxy = stalling_proxy_to(moto_s3.port)
    tier = fast_failing(proxy.endpoint_url)
    data = os.urandom(4096)
    assert tier.put(key(0), data, META)
    proxy.stall()

    got, kinds = missed(tier, lambda: tier.get(key(0)))
    assert got is None and kinds and kinds <= {"deadline", "timeout"}, kinds
    found, kinds = missed(tier, lambda: tier.contains_many([key(0), key(1)]))
    assert found == [False, False] and kinds and kinds <= MISS_KINDS, kinds
    stored, kinds = missed(tier, lambda: tier.put(key(2), data, META))
    assert stored is False and kinds and kinds <= MISS_KINDS, kinds
    stats = tier.stats()
    assert stats.degraded
    assert stats.errors_total.get("deadline", 0) + stats.errors_total.get("timeout", 0) >= 2

    proxy.resume()
    wait_for(lambda: tier.get(key(0)) is not None, 10, "hits after the endpoint resumes")
    assert not tier.stats().degraded
    tier.close()


@pytest.mark.timeout(120)
def test_stopped_endpoint_costs_misses_and_the_bucket_is_made_again_on_return(
    own_moto_s3: MotoS3Server, fast_failing
) -> None:
    tier = fast_failing(own_moto_s3.endpoint_url)
    data = os.urandom(4096)
    # Set-up, not the behaviour under test: on a loaded machine the first PUT
    # (bucket creation included) may miss the short deadline once.
    wait_for(lambda: tier.put(key(0), data, META), 10, "a first PUT within the deadline")
    own_moto_s3.stop()

    for i in range(4):
        got, kinds = missed(tier, lambda i=i: tier.get(key(i)))
        assert got is None and kinds and kinds <= MISS_KINDS, kinds
        assert tier.put(key(i + 10), data, META) is False
    stats = tier.stats()
    assert stats.degraded
    assert stats.errors_total.get("connection", 0) >= 2

    own_moto_s3.start()  # same port, empty: no bucket, no objects
    wait_for(
        lambda: tier.put(key(0), data, META) and tier.get(key(0)) is not None,
        10,
        "stores and hits after the endpoint returns",
    )
    assert not tier.stats().degraded
    tier.close()


def test_large_object_goes_up_in_parts_and_comes_back_intact(
    moto_s3, moto_s3_raw, s3_config
) -> None:
    config = s3_config(
        moto_s3.endpoint_url,
        s3={"multipart_threshold_bytes": "5Mi", "multipart_chunk_bytes": "5Mi"},
    )
    tier = build_shared_tier(config)
    data = os.urandom(12 << 20)
    assert tier.put(key(1), data, ChunkMeta(dtype="uint8", shape=(len(data),)))
    got = tier.get(key(1))
    assert got is not None and bytes(got.payload) == data
    etag = moto_s3_raw.head_object(Bucket=config.s3.bucket, Key=config.s3.prefix + key_hex(key(1)))[
        "ETag"
    ]
    assert etag.strip('"').endswith("-3")  # a multipart ETag: 5 + 5 + 2 MiB parts
    tier.clear()
    tier.close()


def test_half_set_credential_files_are_refused_naming_the_fields(s3_credentials) -> None:
    from kvstrata.sidecar.config import SharedConfig

    config = SharedConfig(
        backend="s3", s3={"access_key_id_file": s3_credentials["access_key_id_file"]}
    )
    with pytest.raises(ValueError, match=r"shared\.s3\.secret_access_key_file"):
        build_shared_tier(config)
