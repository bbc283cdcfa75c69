"""S3 ``get_into``: an object's payload received straight into its destination.

Real moto server. The first test pins what :mod:`kvstrata.sidecar.tiers.s3body`
relies on in the installed botocore, urllib3 and http.client; the others
show the tier's answers: the bytes placed, counted, a corrupt object refused
and deleted, compressed and older objects, nowhere to put it, a missing
object, a held response, and a body that stops arriving halfway.
"""

from __future__ import annotations

import http.client
import os
import time
from collections.abc import Callable

import pytest
import urllib3

from kvstrata.sidecar.keys import ChunkKey, Namespace, make_key
from kvstrata.sidecar.objformat import ChunkMeta, encode_bytes
from kvstrata.sidecar.tiers.s3 import S3Tier
from kvstrata.sidecar.tiers.s3body import PIECE_BYTES, BodyStream
from kvstrata.testing.destination import Destination
from kvstrata.testing.servers import MotoS3Server

NS = Namespace(model="s3-get-into").fingerprint()


def key(i: int) -> ChunkKey:
    return make_key(NS, i.to_bytes(32, "big"))


def meta(size: int) -> ChunkMeta:
    return ChunkMeta(dtype="uint8", shape=(size,))


@pytest.fixture
def tiers(s3_tiers: Callable[..., S3Tier]) -> Callable[..., S3Tier]:
    return s3_tiers


def test_the_installed_clients_let_a_body_be_read_into_a_buffer(tiers) -> None:
    """botocore's body wraps urllib3's response, which wraps http.client's;
    reading that one to its end closes it, and the connection is released."""
    tier = tiers()
    size = 3 * PIECE_BYTES + 5
    data = os.urandom(size)
    assert tier.put(key(1), data, meta(size))
    response = tier._client.get_object(Bucket=tier._config.bucket, Key=tier._name(key(1)))
    raw = response["Body"]._raw_stream
    assert isinstance(raw, urllib3.response.HTTPResponse)
    assert isinstance(raw._fp, http.client.HTTPResponse)
    body = BodyStream(response, deadline=time.monotonic() + 60)
    assert body.zero_copy
    out = bytearray(body.size)
    body.fill(memoryview(out))
    assert raw._fp.isclosed()  # http.client saw the last byte of the Content-Length body
    body.finish()
    assert raw._connection is None  # released to the pool (close() keeps it)
    assert bytes(out) == _object(tier, key(1))  # what botocore's own read gives


def _object(tier: S3Tier, k: ChunkKey) -> bytes:
    return tier._client.get_object(Bucket=tier._config.bucket, Key=tier._name(k))["Body"].read()


@pytest.mark.parametrize("size", [1, 100, 200_000, 3 * PIECE_BYTES + 5])
def test_get_into_writes_the_payload_where_place_says_and_counts_it(tiers, size: int) -> None:
    tier = tiers()
    data = os.urandom(size)
    assert tier.put(key(size), data, meta(size))
    dest = Destination()
    assert tier.get_into(key(size), dest) == meta(size)
    assert dest.asked == [(size, meta(size))]
    assert bytes(dest.buffer) == data
    stats = tier.stats()
    assert (stats.hits_total, stats.misses_total, stats.corrupt_total) == (1, 0, 0)
    assert stats.retrieved_bytes_total == len(_object(tier, key(size)))
    assert stats.errors_total == {}


def test_a_body_read_by_the_public_read_gives_the_same_bytes(tiers) -> None:
    """The fallback for a botocore without http.client underneath (forced here
    by clearing the reader the stream found: a stand-in for that botocore)."""
    tier = tiers()
    size = 2 * PIECE_BYTES + 3
    data = os.urandom(size)
    assert tier.put(key(1), data, meta(size))
    response = tier._client.get_object(Bucket=tier._config.bucket, Key=tier._name(key(1)))
    body = BodyStream(response, deadline=time.monotonic() + 60)
    body._readinto = None
    out = bytearray(body.size)
    body.fill(memoryview(out))
    body.finish()
    assert bytes(out) == _object(tier, key(1))


def test_get_into_a_flipped_byte_is_a_counted_miss_and_deleted(tiers) -> None:
    tier = tiers()
    size = 300_000
    assert tier.put(key(1), os.urandom(size), meta(size))
    blob = bytearray(_object(tier, key(1)))
    blob[len(blob) // 2] ^= 0x01
    tier._client.put_object(Bucket=tier._config.bucket, Key=tier._name(key(1)), Body=bytes(blob))
    dest = Destination()
    assert tier.get_into(key(1), dest) is None
    assert len(dest.asked) == 1  # written, then refused: the caller drops what it reserved
    assert (tier.stats().corrupt_total, tier.stats().misses_total) == (1, 1)
    assert tier.contains_many([key(1)]) == [False]


def test_get_into_reads_compressed_and_older_format_objects(tiers) -> None:
    data = b"\x01\x3f" * 50_000  # compressible
    assert tiers(codec="zstd").put(key(1), data, meta(len(data)))
    tier = tiers()
    older = encode_bytes(bytes(key(2)), data, meta(len(data)))  # checksum in the header
    tier._client.put_object(Bucket=tier._config.bucket, Key=tier._name(key(2)), Body=older)
    for k in (key(1), key(2)):
        dest = Destination()
        assert tier.get_into(k, dest) == meta(len(data))
        assert bytes(dest.buffer) == data
    assert tier.stats().corrupt_total == 0


def test_get_into_with_nowhere_to_put_it_or_nothing_there_is_a_plain_miss(tiers) -> None:
    tier = tiers()
    assert tier.put(key(1), os.urandom(1000), meta(1000))
    nowhere = Destination(room=False)
    assert tier.get_into(key(1), nowhere) is None and len(nowhere.asked) == 1
    absent = Destination()
    assert tier.get_into(key(2), absent) is None and absent.asked == []
    stats = tier.stats()
    assert (stats.misses_total, stats.hits_total, stats.corrupt_total) == (2, 0, 0)
    assert stats.errors_total == {} and not stats.degraded


def test_get_into_reads_the_response_a_lookup_held(tiers) -> None:
    tier = tiers()
    data = os.urandom(500_000)
    assert tier.put(key(1), data, meta(len(data)))
    sent: list[str] = []
    tier._client.meta.events.register(
        "before-call.s3.*", lambda model, **_: sent.append(model.name)
    )
    assert tier.contains_many_ahead([key(1)]) == [True]
    dest = Destination()
    assert tier.get_into(key(1), dest) == meta(len(data))
    assert bytes(dest.buffer) == data
    assert sent == ["GetObject"]  # the lookup's; the fetch read its body
    assert tier.stats().lookup_gets_used_total == 1


@pytest.mark.timeout(60)
def test_a_body_that_stops_arriving_is_a_miss_after_its_deadline(
    tiers, moto_s3: MotoS3Server, stalling_proxy_to
) -> None:
    """The link slows to a trickle once the object is asked for: the first
    piece takes seconds, longer than the tier's 0.5 s deadline, so the read
    ends there, a counted timeout; the destination was handed out and the
    answer says it holds no valid payload. At full speed again, it reads."""
    proxy = stalling_proxy_to(moto_s3.port)
    tier = tiers(proxy.endpoint_url, s3={"timeout_seconds": 0.5, "max_attempts": 1})
    size = 2 * PIECE_BYTES
    data = os.urandom(size)
    assert tier.put(key(1), data, meta(size))
    proxy.throttle(256 * 1024)
    dest = Destination()
    assert tier.get_into(key(1), dest) is None
    assert len(dest.asked) == 1
    assert tier.stats().errors_total.get("timeout", 0) == 1
    proxy.resume()
    again = Destination()
    assert tier.get_into(key(1), again) == meta(size) and bytes(again.buffer) == data


@pytest.mark.timeout(60)
def test_a_stalled_endpoint_is_a_miss_before_anything_is_placed(
    tiers, moto_s3: MotoS3Server, stalling_proxy_to
) -> None:
    proxy = stalling_proxy_to(moto_s3.port)
    tier = tiers(proxy.endpoint_url, s3={"timeout_seconds": 0.5, "max_attempts": 3})
    assert tier.put(key(1), b"\x07" * 1000, meta(1000))
    proxy.stall()
    dest = Destination()
    assert tier.get_into(key(1), dest) is None
    assert dest.asked == []
    errors = tier.stats().errors_total
    assert errors and set(errors) <= {"deadline", "timeout"}, errors
    proxy.resume()
    again = Destination()
    assert tier.get_into(key(1), again) == meta(1000) and bytes(again.buffer) == b"\x07" * 1000
