"""Rendering a KVCache: the sidecar config loads in the sidecar's loader, objects are valid."""

from __future__ import annotations

import base64

import pytest

from kvstrata.operator import reconcile as rec
from kvstrata.operator import resources as R
from kvstrata.operator import spec as S
from kvstrata.sidecar.config import load_config
from kvstrata.sidecar.transfer_mode import ModeSetting

SPECS = {
    "defaults": {},
    "small-l1-lfu": {"l1": {"size": "64Mi", "policy": "lfu"}, "l2": {"enabled": False}},
    "s3fifo-int-sizes": {"l1": {"size": 1 << 30, "policy": "s3fifo"}, "l2": {"size": 10**9}},
    "valkey-managed": {
        "chunkSize": 512,
        "shared": {"backend": "valkey", "codec": "zstd", "valkey": {"managed": {"replicas": 3}}},
    },
    "valkey-managed-no-auth": {
        "shared": {"backend": "valkey", "valkey": {"managed": {"auth": {"enabled": False}}}}
    },
    "valkey-external-tls": {
        "transferMode": "host",
        "shared": {
            "backend": "valkey",
            "admission": "reused",
            "valkey": {
                "ttlSeconds": 3600,
                "keyPrefix": "team-a:",
                "external": {
                    "url": "rediss://valkey.cache.svc:6380/0",
                    "cluster": True,
                    "username": "kv",
                    "passwordSecretRef": {"name": "valkey-pass"},
                    "tls": {"caSecretRef": {"name": "valkey-ca"}},
                },
            },
        },
    },
    "s3": {
        "transferMode": "ipc",
        "shared": {
            "backend": "s3",
            "codec": "lz4",
            "s3": {
                "endpoint": "http://minio.storage:9000",
                "bucket": "kv-cache",
                "prefix": "llama/",
                "createBucket": True,
                "credentialsSecretRef": {"name": "s3-creds"},
            },
        },
    },
    "metrics": {"metrics": {"port": 9100, "serviceMonitor": {"enabled": True}}},
}


@pytest.mark.parametrize("spec", SPECS.values(), ids=SPECS.keys())
def test_rendered_config_loads_back_equal_in_the_sidecar_loader(spec, make_kvcache, tmp_path):
    kvcache = make_kvcache(**spec)
    config, text = S.render_sidecar_config(kvcache)
    path = tmp_path / "sidecar.yaml"
    path.write_text(text)
    assert load_config(path, env={}) == config
    assert config.server.endpoint == S.ENDPOINT
    assert config.l2.path == S.L2_DIR


def test_spec_fields_reach_the_config(make_kvcache):
    config, _ = S.render_sidecar_config(make_kvcache(**SPECS["valkey-external-tls"]))
    assert config.transfer_mode is ModeSetting.HOST
    assert config.shared.backend == "valkey"
    assert config.shared.admission == "reused"
    assert config.shared.valkey.url == "rediss://valkey.cache.svc:6380/0"
    assert config.shared.valkey.cluster is True
    assert config.shared.valkey.password_file == S.VALKEY_PASSWORD_FILE
    assert config.shared.valkey.tls_ca_file == S.VALKEY_CA_FILE
    assert config.shared.valkey.ttl_seconds == 3600
    s3, _ = S.render_sidecar_config(make_kvcache(**SPECS["s3"]))
    assert s3.shared.s3.bucket == "kv-cache"
    assert s3.shared.s3.endpoint_url == "http://minio.storage:9000"
    assert s3.shared.s3.access_key_id_file == S.S3_ACCESS_KEY_FILE
    managed, _ = S.render_sidecar_config(make_kvcache(**SPECS["valkey-managed"]))
    assert managed.shared.valkey.url == "redis://demo-valkey.ml.svc:6379/0"
    assert managed.chunk_size == 512


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"l1": {"size": "512Ki"}}, "l1.size_bytes"),
        ({"l1": {"size": "lots"}}, "l1.size_bytes"),
        ({"l1": {"policy": "random"}}, "l1.policy"),
        ({"chunkSize": 0}, "chunk_size"),
        ({"shared": {"backend": "s3", "s3": {}}}, "spec.shared.s3.bucket"),
        ({"shared": {"backend": "valkey", "valkey": {"external": {}}}}, "external.url"),
    ],
)
def test_a_spec_the_loader_refuses_names_the_field(spec, field, make_kvcache):
    with pytest.raises(S.SpecError, match=field.replace(".", r"\.")):
        S.render_sidecar_config(make_kvcache(**spec))


@pytest.mark.parametrize("spec", SPECS.values(), ids=SPECS.keys())
def test_owned_objects_are_valid_kubernetes_objects_with_owner_references(
    spec, make_kvcache, cluster, k8s_valid
):
    kvcache = make_kvcache(**spec)
    objects, digest, _ = rec.desired_objects(kvcache, cluster)
    assert objects[0]["kind"] == "ConfigMap"
    for obj in objects:
        if obj["apiVersion"].startswith("monitoring.coreos.com"):
            assert obj["spec"]["endpoints"][0]["port"] == "metrics"
        else:
            k8s_valid(obj)
        ref = obj["metadata"]["ownerReferences"][0]
        assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == (
            "KVCache",
            "demo",
            "uid-demo",
            True,
        )
        assert obj["metadata"]["labels"]["app.kubernetes.io/instance"] == "demo"
    assert len(digest) == 16


@pytest.mark.parametrize("spec", SPECS.values(), ids=SPECS.keys())
def test_rendering_twice_gives_identical_objects(spec, make_kvcache, cluster):
    kvcache = make_kvcache(**spec)
    first, d1, _ = rec.desired_objects(kvcache, cluster)
    for obj in first:
        cluster.apply(obj)  # the stored password is reused from here on
    second, d2, _ = rec.desired_objects(kvcache, cluster)
    third, _, _ = rec.desired_objects(kvcache, cluster)
    assert second == third
    assert d1 == d2
    assert first == second


def test_managed_valkey_password_is_generated_once_and_kept(make_kvcache, cluster):
    kvcache = make_kvcache(**SPECS["valkey-managed"])
    for obj in rec.desired_objects(kvcache, cluster)[0]:
        cluster.apply(obj)
    secret = cluster.get("v1", "Secret", "ml", "demo-valkey-auth")
    password = base64.b64decode(secret["data"]["password"]).decode()
    assert len(password) >= 32
    again = next(o for o in rec.desired_objects(kvcache, cluster)[0] if o["kind"] == "Secret")
    assert base64.b64decode(again["data"]["password"]).decode() == password
    other = make_kvcache(name="other", **SPECS["valkey-managed"])
    fresh = next(o for o in rec.desired_objects(other, cluster)[0] if o["kind"] == "Secret")
    assert fresh["data"]["password"] != secret["data"]["password"]


def test_valkey_statefulset_persistence_uses_claim_templates(make_kvcache, k8s_valid):
    managed = {
        "replicas": 2,
        "maxMemory": "2Gi",
        "persistence": {"enabled": True, "size": "20Gi", "storageClassName": "fast"},
    }
    kvcache = make_kvcache(shared={"backend": "valkey", "valkey": {"managed": managed}})
    sts = R.render_valkey_statefulset(kvcache)
    k8s_valid(sts)
    claim = sts["spec"]["volumeClaimTemplates"][0]["spec"]
    assert claim["storageClassName"] == "fast"
    assert claim["resources"]["requests"]["storage"] == "20Gi"
    script = sts["spec"]["template"]["spec"]["containers"][0]["args"][0]
    assert "--appendonly yes" in script and f"--maxmemory {2 << 30}" in script
    assert "--replicaof demo-valkey-0.demo-valkey-headless.ml.svc 6379" in script
    ephemeral = R.render_valkey_statefulset(make_kvcache(shared={"backend": "valkey"}))
    assert "volumeClaimTemplates" not in ephemeral["spec"]
    assert ephemeral["spec"]["template"]["spec"]["volumes"] == [{"name": "data", "emptyDir": {}}]


def test_config_hash_changes_with_any_spec_change(make_kvcache):
    base = make_kvcache(l1={"size": "1Gi"})
    other = make_kvcache(l1={"size": "1Gi"}, sidecar={"image": "example/kvstrata:2"})
    _, text = S.render_sidecar_config(base)
    _, text2 = S.render_sidecar_config(other)
    assert text == text2
    assert S.config_hash(base, text) != S.config_hash(other, text2)
