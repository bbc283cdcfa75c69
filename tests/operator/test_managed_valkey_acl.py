"""The managed Valkey, run from the operator's own StatefulSet command on a real
server: no anonymous access, the sidecars' ACL user confined to its KVCache's key
prefix, replicas authenticated by a user that may only replicate."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from kvstrata.operator import resources
from kvstrata.operator import spec as S
from kvstrata.sidecar.keys import Namespace, make_key
from kvstrata.sidecar.objformat import ChunkMeta
from kvstrata.sidecar.tiers.valkey import ValkeyTier
from kvstrata.testing.poll import wait_until
from kvstrata.testing.servers import ServerError, free_port, redis_server_binary

MANAGED = {"backend": "valkey", "valkey": {"managed": {"replicas": 2}}}
PASSWORD = "s3cret-pw"
META = ChunkMeta(dtype="uint8", shape=(4096,))
KEY = make_key(Namespace(model="managed-acl").fingerprint(), b"\x09" * 32)
PAYLOAD = bytes(range(256)) * 16


def valkey_script(kvcache: dict[str, Any]) -> str:
    sts = resources.render_valkey_statefulset(kvcache)
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["/bin/sh", "-c"]
    return container["args"][0]


@pytest.fixture
def run_pod(tmp_path: Path) -> Iterator[Any]:
    """Runs the rendered container command as pod ``ordinal`` on loopback."""
    try:
        binary = redis_server_binary()
    except ServerError as exc:
        pytest.fail(f"{exc}; run `make system-deps`")
    procs: list[subprocess.Popen[bytes]] = []

    def run(script: str, ordinal: int, primary_port: int | None = None) -> int:
        port = free_port()
        data = tmp_path / f"data-{ordinal}"
        data.mkdir()
        local = script.replace("exec valkey-server", f"exec {binary}")
        local = local.replace("--port 6379", f"--port {port} --bind 127.0.0.1")
        local = local.replace("--dir /data", f"--dir {data}")
        if primary_port is not None:  # the headless Service's DNS name, on loopback
            local = local.replace("--replicaof a-valkey-0.a-valkey-headless.team-1.svc 6379",
                                  f"--replicaof 127.0.0.1 {primary_port}")  # fmt: skip
        env = {
            "HOSTNAME": f"a-valkey-{ordinal}",
            "VALKEY_PASSWORD": PASSWORD,
            "PATH": "/usr/bin:/bin",
        }
        log = (tmp_path / f"valkey-{ordinal}.log").open("wb")
        procs.append(subprocess.Popen(["/bin/sh", "-c", local], env=env, stdout=log, stderr=log))
        wait_until(lambda: _answers(port), 10, f"valkey pod {ordinal} on {port}")
        return port

    yield run
    for proc in procs:
        proc.kill()
        proc.wait(10)


def _answers(port: int) -> bool:
    try:
        redis.Redis(port=port, socket_timeout=1).ping()
    except redis.AuthenticationError:
        return True  # up, and refusing anonymous clients
    except redis.ResponseError as exc:
        return "NOAUTH" in str(exc)
    except redis.ConnectionError:
        return False
    return True


def sidecar_tier(kvcache: dict[str, Any], port: int, tmp_path: Path, prefix: str | None = None):
    """The Valkey tier exactly as the rendered sidecar config sets it up, on loopback."""
    config, _ = S.render_sidecar_config(kvcache)
    valkey = config.shared.valkey
    assert valkey.username == S.MANAGED_VALKEY_USER
    secret = tmp_path / "password"
    secret.write_text(PASSWORD)
    update = {"url": f"redis://127.0.0.1:{port}/0", "password_file": str(secret)}
    if prefix is not None:
        update["key_prefix"] = prefix
    shared = config.shared.model_copy(update={"valkey": valkey.model_copy(update=update)})
    return ValkeyTier(shared)


def test_the_sidecars_user_reads_and_writes_its_own_prefix_only(make_kvcache, run_pod, tmp_path):
    kvcache = make_kvcache("a", "team-1", shared=MANAGED)
    port = run_pod(valkey_script(kvcache), ordinal=0)
    own = sidecar_tier(kvcache, port, tmp_path)
    other = sidecar_tier(kvcache, port, tmp_path, prefix=S.default_key_prefix("b", "team-1"))
    try:
        assert own.put(KEY, PAYLOAD, META)
        got = own.get(KEY)
        assert got is not None and bytes(got.payload) == PAYLOAD
        assert not other.put(KEY, PAYLOAD, META), "a key outside the cache's prefix was written"
        assert other.get(KEY) is None
    finally:
        own.close()
        other.close()
    with pytest.raises((redis.AuthenticationError, redis.ResponseError), match=r"(?i)auth"):
        redis.Redis(port=port).get("anything")  # no anonymous access
    user = redis.Redis(port=port, username=S.MANAGED_VALKEY_USER, password=PASSWORD)
    with pytest.raises(redis.exceptions.NoPermissionError):
        user.flushall()  # -@dangerous


def test_a_replica_follows_the_primary_as_the_replication_user(make_kvcache, run_pod, tmp_path):
    kvcache = make_kvcache("a", "team-1", shared=MANAGED)
    script = valkey_script(kvcache)
    primary = run_pod(script, ordinal=0)
    replica = run_pod(script, ordinal=1, primary_port=primary)
    tier = sidecar_tier(kvcache, primary, tmp_path)
    try:
        assert tier.put(KEY, PAYLOAD, META)
    finally:
        tier.close()
    follower = sidecar_tier(kvcache, replica, tmp_path)
    try:
        got = wait_until(lambda: follower.get(KEY), 30, "the replica to sync", step=0.2)
        assert bytes(got.payload) == PAYLOAD
    finally:
        follower.close()
