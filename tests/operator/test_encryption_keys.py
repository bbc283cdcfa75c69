"""The encryption keys Secret: created, mounted, rotated in two passes, pruned
after its objects expire, and read by the sidecar's own key ring."""

from __future__ import annotations

import base64
import copy
import datetime as dt
import json

import jsonpatch

from kvstrata.operator import encryption as E
from kvstrata.operator import reconcile as rec
from kvstrata.operator import spec as S
from kvstrata.operator.model import KVCache
from kvstrata.operator.mutate import mutate_pod
from kvstrata.operator.sidecar_container import SIDECAR
from kvstrata.sidecar.sealing import KeyRing
from kvstrata.testing.keyfolder import MountedSecret

CACHE = {S.CACHE_ANNOTATION: "demo"}
T0 = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)


def at(**delta: float) -> dt.datetime:
    return T0 + dt.timedelta(**delta)


def index_of(secret: dict) -> dict:
    return json.loads(base64.b64decode(secret["data"][E.INDEX_FILE]))


def pass_at(kvcache: KVCache, secret: dict | None, moment: dt.datetime) -> dict:
    out, _ = E.desired_keys_secret(kvcache, secret, moment)
    assert out is not None
    return out


def test_encryption_off_creates_no_secret_and_mounts_nothing(make_kvcache, make_pod) -> None:
    kvcache = KVCache.parse(make_kvcache())
    assert E.desired_keys_secret(kvcache, None, T0) == (None, [])
    out = mutate_pod(make_pod(CACHE), make_kvcache())
    patched = jsonpatch.apply_patch(copy.deepcopy(make_pod(CACHE)), out.patch)
    assert "kvstrata-keys" not in {v["name"] for v in patched["spec"]["volumes"]}
    config, _ = S.render_sidecar_config(kvcache)
    assert config.encryption.mode == "off"


def test_first_pass_creates_one_writing_key_the_sidecar_reads(make_kvcache, tmp_path) -> None:
    kvcache = KVCache.parse(make_kvcache(encryption={"mode": "required"}))
    secret, changes = E.desired_keys_secret(kvcache, None, T0)
    assert secret is not None and secret["metadata"]["name"] == "demo-keys"
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "uid-demo"
    assert len(changes) == 1 and "created" in changes[0]
    files = {k: base64.b64decode(v) for k, v in secret["data"].items()}
    writing = index_of(secret)["writing"]
    assert len(files[f"{writing}.key"]) == 32
    MountedSecret(tmp_path).publish(files)
    ring = KeyRing("required", str(tmp_path))
    assert ring.writing_key_id == writing and ring.key_ids == [writing]


def test_a_pass_within_the_period_changes_nothing(make_kvcache) -> None:
    kvcache = KVCache.parse(make_kvcache(encryption={"mode": "on", "rotateEvery": "1d"}))
    first = pass_at(kvcache, None, T0)
    again, changes = E.desired_keys_secret(kvcache, first, at(hours=23))
    assert again == first and changes == []


def test_rotation_stages_the_new_key_then_makes_it_writing(make_kvcache, tmp_path) -> None:
    kvcache = KVCache.parse(make_kvcache(encryption={"mode": "on", "rotateEvery": "1d"}))
    first = pass_at(kvcache, None, T0)
    old = index_of(first)["writing"]
    staged = pass_at(kvcache, first, at(days=1))
    index = index_of(staged)
    assert index["writing"] == old and len(index["keys"]) == 2
    # A pass before every kubelet has the new file keeps writing with the old key.
    early = pass_at(kvcache, staged, at(days=1, seconds=E.PROPAGATION_SECONDS - 1))
    assert index_of(early)["writing"] == old
    promoted = pass_at(kvcache, early, at(days=1, seconds=E.PROPAGATION_SECONDS))
    index = index_of(promoted)
    new = index["writing"]
    assert new != old and index["keys"][old]["retired"] is not None
    files = {k: base64.b64decode(v) for k, v in promoted["data"].items()}
    MountedSecret(tmp_path).publish(files)
    ring = KeyRing("on", str(tmp_path))
    assert ring.writing_key_id == new and ring.key_ids == sorted([old, new])


def test_a_retired_key_is_kept_until_the_shared_tiers_objects_expire(make_kvcache) -> None:
    shared = {"backend": "valkey", "valkey": {"ttlSeconds": 7 * 86400, "managed": {}}}
    kvcache = KVCache.parse(
        make_kvcache(encryption={"mode": "on", "rotateEvery": "1d"}, shared=shared)
    )
    assert E.retention_seconds(kvcache) == 7 * 86400
    secret = pass_at(kvcache, None, T0)
    old = index_of(secret)["writing"]
    secret = pass_at(kvcache, secret, at(days=1))
    promoted_at = at(days=1, seconds=E.PROPAGATION_SECONDS)
    secret = pass_at(kvcache, secret, promoted_at)
    later = promoted_at + dt.timedelta(days=7) - dt.timedelta(seconds=1)
    assert old in index_of(pass_at(kvcache, secret, later))["keys"]
    pruned = pass_at(kvcache, secret, promoted_at + dt.timedelta(days=7))
    assert old not in index_of(pruned)["keys"]
    assert f"{old}.key" not in pruned["data"]


def test_without_a_tier_expiry_a_retired_key_lives_one_more_period(make_kvcache) -> None:
    kvcache = KVCache.parse(make_kvcache(encryption={"mode": "on", "rotateEvery": "30d"}))
    assert E.retention_seconds(kvcache) == 30 * 86400


def test_a_bad_rotation_period_is_an_invalid_spec_naming_the_field(make_kvcache, cluster) -> None:
    out = rec.reconcile(
        make_kvcache(encryption={"mode": "on", "rotateEvery": "soon"}),
        cluster,
        now="2026-01-01T00:00:00Z",
    )
    assert out.permanent is not None and "spec.encryption.rotateEvery" in out.permanent


def test_reconcile_creates_then_rotates_the_secret_without_rolling_workloads(
    make_kvcache, cluster
) -> None:
    kvcache = make_kvcache(encryption={"mode": "on", "rotateEvery": "1h"})
    first = rec.reconcile(kvcache, cluster, now="2026-01-01T00:00:00Z")
    secret = cluster.get("v1", "Secret", "ml", "demo-keys")
    assert secret is not None
    old = index_of(secret)["writing"]
    assert any(e.reason == "EncryptionKeys" for e in first.events)
    rec.reconcile(kvcache, cluster, now="2026-01-01T01:00:00Z")
    rotated = rec.reconcile(kvcache, cluster, now="2026-01-01T01:03:00Z")
    new = index_of(cluster.get("v1", "Secret", "ml", "demo-keys"))["writing"]
    assert new != old
    assert rotated.status["configHash"] == first.status["configHash"]
    config = S.render_sidecar_config(KVCache.parse(kvcache))[0]
    assert config.encryption.key_dir == S.ENCRYPTION_KEY_DIR


def test_the_sidecar_mounts_the_whole_keys_secret_read_only(make_kvcache, make_pod, k8s_valid):
    kvcache = make_kvcache(encryption={"mode": "required"})
    pod = make_pod(CACHE)
    result = mutate_pod(pod, kvcache)
    out = jsonpatch.apply_patch(copy.deepcopy(pod), result.patch)
    k8s_valid(out)
    volume = next(v for v in out["spec"]["volumes"] if v["name"] == "kvstrata-keys")
    assert volume["secret"]["secretName"] == "demo-keys"
    assert "items" not in volume["secret"]  # keys a rotation adds must appear in place
    sidecar = next(c for c in out["spec"]["initContainers"] if c["name"] == SIDECAR)
    mount = next(m for m in sidecar["volumeMounts"] if m["name"] == "kvstrata-keys")
    assert mount == {"name": "kvstrata-keys", "mountPath": S.ENCRYPTION_KEY_DIR, "readOnly": True}
    assert "subPath" not in mount
    vllm = next(c for c in out["spec"]["containers"] if c["name"] == "vllm")
    assert all(m["name"] != "kvstrata-keys" for m in vllm.get("volumeMounts", []))
