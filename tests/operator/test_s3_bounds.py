"""A KVCache's S3 prefix is bounded: an expiry rule the operator merges into the
bucket's lifecycle, and a size cap its sweeper keeps, least recently used first.

All on a real S3 endpoint: moto's server, served in this process
(:class:`~kvstrata.testing.servers.AgeableMotoS3`) so a test can make objects
older (``age``) instead of waiting days for them to be.
"""

from __future__ import annotations

import base64
import os
from collections.abc import Iterator
from typing import Any

import boto3
import pytest
import yaml

from kvstrata.operator import reconcile as rec
from kvstrata.operator import s3bounds, sharedtier
from kvstrata.operator import spec as S
from kvstrata.operator.metrics import OperatorMetrics, observe_outcome
from kvstrata.operator.model import KVCache, SpecError
from kvstrata.sidecar.config import SharedConfig
from kvstrata.sidecar.keys import Namespace, key_hex, make_key
from kvstrata.sidecar.objformat import ChunkMeta
from kvstrata.sidecar.tiers.s3 import S3Tier
from kvstrata.testing.servers import AgeableMotoS3

NOW = "2026-01-01T00:00:00Z"
DAY = 86400.0
BUCKET = "bounded-cache"


def cond(status: dict, ctype: str) -> dict:
    return next(c for c in status["conditions"] if c["type"] == ctype)


@pytest.fixture(scope="module")
def s3_server() -> Iterator[AgeableMotoS3]:
    with AgeableMotoS3() as server:
        yield server


@pytest.fixture
def client(s3_server: AgeableMotoS3) -> Iterator[Any]:
    c = boto3.client(
        "s3",
        endpoint_url=s3_server.endpoint_url,
        region_name="us-east-1",
        aws_access_key_id="AK",
        aws_secret_access_key="SK",
    )
    yield c
    c.close()


@pytest.fixture
def s3_cluster(cluster):
    data = {"access-key-id": "AK", "secret-access-key": "SK"}
    cluster.put(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "creds", "namespace": "ml"},
            "data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()},
        }
    )
    return cluster


def s3_cache(make_kvcache, s3_server: AgeableMotoS3, name: str, prefix: str, **bounds: Any):
    s3 = {
        "endpoint": s3_server.endpoint_url,
        "bucket": BUCKET,
        "prefix": prefix,
        "createBucket": True,
        "credentialsSecretRef": {"name": "creds"},
        **bounds,
    }
    return make_kvcache(name=name, shared={"backend": "s3", "s3": s3})


def rules(client: Any) -> dict[str, dict]:
    try:
        found = client.get_bucket_lifecycle_configuration(Bucket=BUCKET)["Rules"]
    except client.exceptions.ClientError as exc:
        assert exc.response["Error"]["Code"] == "NoSuchLifecycleConfiguration"
        return {}
    return {r["ID"]: r for r in found}


def test_expiry_days_become_a_lifecycle_rule_on_the_prefix(
    make_kvcache, s3_cluster, s3_server, client
) -> None:
    out = rec.reconcile(
        s3_cache(make_kvcache, s3_server, "expiring", "exp/", expiryDays=7), s3_cluster, now=NOW
    )
    assert cond(out.status, "Ready")["status"] == "True"
    assert cond(out.status, "Degraded")["status"] == "False"
    rule = rules(client)["kvstrata:ml/expiring"]
    assert rule["Status"] == "Enabled"
    assert rule["Filter"]["Prefix"] == "exp/"
    assert rule["Expiration"]["Days"] == 7
    assert rule["AbortIncompleteMultipartUpload"]["DaysAfterInitiation"] == 1


def test_the_rule_is_merged_with_foreign_rules_and_removed_alone(
    make_kvcache, s3_cluster, s3_server, client
) -> None:
    rec.reconcile(s3_cache(make_kvcache, s3_server, "first", "a/"), s3_cluster, now=NOW)
    foreign = {
        "ID": "archive-logs",
        "Filter": {"Prefix": "logs/"},
        "Status": "Enabled",
        "Expiration": {"Days": 90},
    }
    client.put_bucket_lifecycle_configuration(
        Bucket=BUCKET, LifecycleConfiguration={"Rules": [foreign]}
    )

    rec.reconcile(
        s3_cache(make_kvcache, s3_server, "first", "a/", expiryDays=3), s3_cluster, now=NOW
    )
    rec.reconcile(
        s3_cache(make_kvcache, s3_server, "second", "b/", expiryDays=10), s3_cluster, now=NOW
    )
    found = rules(client)
    assert set(found) == {"archive-logs", "kvstrata:ml/first", "kvstrata:ml/second"}
    assert found["archive-logs"]["Expiration"]["Days"] == 90
    assert found["archive-logs"]["Filter"]["Prefix"] == "logs/"
    assert found["kvstrata:ml/first"]["Expiration"]["Days"] == 3
    assert found["kvstrata:ml/second"]["Filter"]["Prefix"] == "b/"

    # expiryDays changed, then dropped: only this KVCache's rule follows.
    rec.reconcile(
        s3_cache(make_kvcache, s3_server, "first", "a/", expiryDays=5), s3_cluster, now=NOW
    )
    assert rules(client)["kvstrata:ml/first"]["Expiration"]["Days"] == 5
    rec.reconcile(s3_cache(make_kvcache, s3_server, "first", "a/"), s3_cluster, now=NOW)
    assert set(rules(client)) == {"archive-logs", "kvstrata:ml/second"}


def test_a_bucket_whose_lifecycle_may_not_be_changed_is_ready_but_degraded(
    make_kvcache, cluster
) -> None:
    # A double for the one fault moto cannot cause: it enforces no permissions.
    def ensure_s3(target: sharedtier.S3Target, owner: str) -> sharedtier.Probe:
        return sharedtier.Probe(
            True, "LifecycleNotApplied", "expiry rule not applied: AccessDenied"
        )

    kvcache = make_kvcache(shared={"backend": "s3", "s3": {"bucket": BUCKET, "expiryDays": 7}})
    out = rec.reconcile(kvcache, cluster, rec.Probes(ensure_s3=ensure_s3), now=NOW)
    assert cond(out.status, "Ready")["status"] == "True"
    degraded = cond(out.status, "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "LifecycleNotApplied"
    assert "AccessDenied" in degraded["message"]
    assert [e.reason for e in out.events if e.type == "Warning"] == ["LifecycleNotApplied"]
    assert out.retry_after is None  # the recheck timer tries again


def credential_files(base) -> dict[str, str]:
    """A sidecar's mounted secret files (moto takes any keys)."""
    (base / "id").write_text("AK\n")
    (base / "secret").write_text("SK\n")
    return {"access_key_id_file": str(base / "id"), "secret_access_key_file": str(base / "secret")}


def put_chunks(tier: S3Tier, n: int) -> list[str]:
    ns = Namespace(model="sweep").fingerprint()
    names = []
    for i in range(n):
        k = make_key(ns, i.to_bytes(32, "big"))
        assert tier.put(k, os.urandom(1000), ChunkMeta("uint8", (1000,)))
        names.append(tier._config.prefix + key_hex(k))
    return names


def test_the_sweeper_deletes_least_recently_used_objects_past_the_cap_and_counts_them(
    make_kvcache, s3_cluster, s3_server, client, tmp_path
) -> None:
    prefix = "swept/"
    kvcache = s3_cache(make_kvcache, s3_server, "capped", prefix)
    rec.reconcile(kvcache, s3_cluster, now=NOW)  # the bucket and the marker
    shared = SharedConfig(
        backend="s3",
        s3={
            "endpoint_url": s3_server.endpoint_url,
            "bucket": BUCKET,
            "prefix": prefix,
            "refresh_after_seconds": DAY,
            **credential_files(tmp_path),
        },
    )
    tier = S3Tier(shared)
    try:
        names = put_chunks(tier, 5)
        for age, name in zip((5, 4, 3, 2, 1), names, strict=True):  # names[0] the oldest
            s3_server.age(BUCKET, name, age * DAY)
        # A sidecar reads the oldest object: refreshed, it becomes the most recent.
        ns = Namespace(model="sweep").fingerprint()
        assert tier.get(make_key(ns, (0).to_bytes(32, "big"))) is not None
        assert tier.drain_refreshes(timeout=10)
    finally:
        tier.close()
    listed = client.list_objects_v2(Bucket=BUCKET, Prefix=prefix)["Contents"]
    sizes = {o["Key"]: o["Size"] for o in listed}
    cap = sizes[names[0]] + sizes[names[3]] + sizes[names[4]]

    capped = s3_cache(make_kvcache, s3_server, "capped", prefix, maxSize=cap)
    metrics = OperatorMetrics()
    out = rec.reconcile(capped, s3_cluster, now=NOW)
    observe_outcome(metrics, capped["metadata"], out, 0.0)

    left = {o["Key"] for o in client.list_objects_v2(Bucket=BUCKET, Prefix=prefix)["Contents"]}
    assert left == {names[0], names[3], names[4], f"{prefix}.kvstrata"}
    assert sum(sizes[n] for n in names if n in left) <= cap  # the marker is not counted
    labels = {"kvcache_namespace": "ml", "kvcache": "capped"}
    sample = metrics.registry.get_sample_value
    assert sample("kvstrata_operator_s3_swept_objects_total", labels) == 2
    assert sample("kvstrata_operator_s3_swept_bytes_total", labels) == (
        sizes[names[1]] + sizes[names[2]]
    )
    assert sample("kvstrata_operator_s3_prefix_bytes", labels) == cap
    assert cond(out.status, "Degraded")["status"] == "False"

    again = rec.reconcile(capped, s3_cluster, now=NOW)  # within the cap: nothing more
    observe_outcome(metrics, capped["metadata"], again, 0.0)
    assert sample("kvstrata_operator_s3_swept_objects_total", labels) == 2
    assert len(client.list_objects_v2(Bucket=BUCKET, Prefix=prefix)["Contents"]) == 4


def test_victims_are_the_oldest_first_and_only_as_many_as_the_cap_needs() -> None:
    import datetime as dt

    t0 = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
    objs = [
        s3bounds.StoredObject("c", 10, t0 + dt.timedelta(days=2)),
        s3bounds.StoredObject("a", 10, t0),
        s3bounds.StoredObject("b", 10, t0 + dt.timedelta(days=1)),
    ]
    assert [o.key for o in s3bounds.victims(objs, 30)] == []
    assert [o.key for o in s3bounds.victims(objs, 25)] == ["a"]
    assert [o.key for o in s3bounds.victims(objs, 10)] == ["a", "b"]
    assert [o.key for o in s3bounds.victims(objs, 0)] == ["a", "b", "c"]


def test_the_sidecar_config_refreshes_reads_when_the_prefix_is_bounded(make_kvcache) -> None:
    def refresh(**s3: Any) -> float | None:
        kvcache = make_kvcache(shared={"backend": "s3", "s3": {"bucket": BUCKET, **s3}})
        config, text = S.render_sidecar_config(kvcache)
        seconds = config.shared.s3.refresh_after_seconds
        assert yaml.safe_load(text)["shared"]["s3"]["refresh_after_seconds"] == seconds
        return seconds

    assert refresh() is None
    assert refresh(expiryDays=1) == DAY / 2
    assert refresh(expiryDays=30) == DAY
    assert refresh(maxSize="100Gi") == DAY


def test_a_bad_max_size_is_refused_naming_the_field(make_kvcache) -> None:
    kvcache = make_kvcache(shared={"backend": "s3", "s3": {"bucket": BUCKET, "maxSize": "lots"}})
    with pytest.raises(SpecError, match=r"spec\.shared\.s3\.maxSize"):
        S.render_sidecar_config(kvcache)
    assert S.s3_max_size_bytes(KVCache.parse(make_kvcache())) is None
