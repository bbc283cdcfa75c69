"""What a kubelet needs from an injected pod that an API server never checks.

An API server takes a pod whose sidecar image is empty-ish, whose memory
volume is smaller than the arena, whose two containers see the socket at
different paths, or whose startup probe gives up before the sidecar could
have reserved its L1: each of these only shows on a node (ImagePullBackOff,
SIGBUS or an evicted pod, a connector that never connects, a sidecar killed
in a restart loop). So each is checked here on the rendered pod, saying why.
"""

from __future__ import annotations

import copy
import json
import math
import re

import jsonpatch
import pytest
import yaml

from kvstrata.operator import reconcile as rec
from kvstrata.operator import spec as S
from kvstrata.operator.mutate import mutate_pod
from kvstrata.operator.sidecar_container import SIDECAR
from kvstrata.testing.apirules import parse_quantity

from .conftest import InMemoryCluster

GIB = 1 << 30
CACHE = {S.CACHE_ANNOTATION: "demo"}
# A docker reference as container runtimes parse it (distribution/reference):
# [registry[:port]/]path[:tag][@digest]; the kubelet pulls exactly this string.
IMAGE_REFERENCE = (
    r"^([a-z0-9.-]+(:\d+)?/)?[a-z0-9]+([._-][a-z0-9]+)*(/[a-z0-9]+([._-][a-z0-9]+)*)*"
    r"(:[\w][\w.-]{0,127})?(@sha256:[0-9a-f]{64})?$"
)


def injected(pod: dict, kvcache: dict) -> dict:
    result = mutate_pod(pod, kvcache)
    assert result.injected, result.skipped
    return jsonpatch.apply_patch(copy.deepcopy(pod), result.patch)


def container(pod: dict, name: str) -> dict:
    everything = pod["spec"].get("initContainers", []) + pod["spec"]["containers"]
    return next(c for c in everything if c["name"] == name)


def mount_of(c: dict, volume: str) -> str:
    return next(m["mountPath"] for m in c["volumeMounts"] if m["name"] == volume)


@pytest.mark.parametrize("gpu", [False, True])
def test_the_sidecar_has_an_image_the_kubelet_can_pull(make_pod, make_kvcache, gpu):
    vllm = {"name": "vllm", "image": "vllm/vllm-openai:v0.8.0", "args": ["--model", "m"]}
    if gpu:
        vllm["resources"] = {"limits": {"nvidia.com/gpu": 1}}
    out = injected(make_pod(CACHE, [vllm]), make_kvcache())
    sidecar = container(out, SIDECAR)
    image = sidecar["image"]
    assert re.match(IMAGE_REFERENCE, image), image
    # A GPU sidecar runs the CUDA kernels: the CUDA image, not the slim one.
    assert ("cuda" in image) == gpu
    assert sidecar["imagePullPolicy"] in ("Always", "IfNotPresent", "Never")


@pytest.mark.parametrize("l1", ["64Mi", "1Gi", "24Gi", "200Gi"])
def test_the_memory_volume_and_the_sidecars_limit_hold_the_whole_l1_arena(
    make_pod, make_kvcache, l1
):
    out = injected(make_pod(CACHE), make_kvcache(l1={"size": l1}))
    l1_bytes = parse_quantity(l1)
    shm = next(v for v in out["spec"]["volumes"] if v["name"] == "kvstrata-shm")
    # The arena is a file in /dev/shm: a tmpfs smaller than it makes the
    # sidecar's reservation fail (or the kubelet evict the pod for exceeding
    # sizeLimit); other shared memory (vLLM's, torch's) needs room too.
    assert shm["emptyDir"]["medium"] == "Memory"
    assert parse_quantity(shm["emptyDir"]["sizeLimit"]) >= l1_bytes + 256 * (1 << 20)
    # tmpfs pages count against the memory cgroup of the container that first
    # touches them: the sidecar, which reserves the whole arena at start. A
    # limit below the arena gets it OOM-killed at start, every time.
    sidecar = container(out, SIDECAR)
    limit = parse_quantity(sidecar["resources"]["limits"]["memory"])
    assert limit >= l1_bytes + 256 * (1 << 20)
    # request = limit: the scheduler reserves on the node what the arena will take.
    assert sidecar["resources"]["requests"]["memory"] == sidecar["resources"]["limits"]["memory"]
    for name in (SIDECAR, "vllm"):  # both map the arena: both mount the same volume at /dev/shm
        assert mount_of(container(out, name), "kvstrata-shm") == "/dev/shm"


def test_the_vllm_container_sees_the_socket_where_the_sidecar_listens(make_pod, make_kvcache):
    kvcache = make_kvcache()
    out = injected(make_pod(CACHE), kvcache)
    sidecar, vllm = container(out, SIDECAR), container(out, "vllm")
    # The sidecar listens where its config (the ConfigMap it mounts) says.
    cluster = InMemoryCluster()
    objects, _, _ = rec.desired_objects(kvcache, cluster)
    configmap = next(o for o in objects if o["kind"] == "ConfigMap")
    config = yaml.safe_load(configmap["data"][S.CONFIG_FILE])
    listen = config["server"]["endpoint"]
    assert listen.startswith("ipc://")
    socket_path = listen.removeprefix("ipc://")
    config_volume = next(v for v in out["spec"]["volumes"] if v["name"] == "kvstrata-config")
    assert config_volume["configMap"]["name"] == configmap["metadata"]["name"]
    assert sidecar["command"][-1] == f"{mount_of(sidecar, 'kvstrata-config')}/{S.CONFIG_FILE}"
    # The connector in vLLM dials the endpoint of --kv-transfer-config ...
    flag = json.loads(vllm["args"][vllm["args"].index("--kv-transfer-config") + 1])
    dial = flag["kv_connector_extra_config"]["endpoint"]
    assert dial == listen
    # ... and both containers mount the one socket volume at the socket's directory.
    directory = socket_path.rsplit("/", 1)[0]
    assert mount_of(sidecar, "kvstrata-socket") == directory
    assert mount_of(vllm, "kvstrata-socket") == directory
    socket_volume = next(v for v in out["spec"]["volumes"] if v["name"] == "kvstrata-socket")
    assert "emptyDir" in socket_volume  # per pod: one pod, one trust domain


# The slowest rate at which a node reserves tmpfs pages that this budget must
# allow for. posix_fallocate of 1 GiB on /dev/shm took 0.23 s on the shared
# 2-core VM the tests run on (about 4 GiB/s); a node eight times slower still starts.
SLOWEST_RESERVE_GIB_PER_S = 0.5
# Interpreter, imports and tiers before the arena, on a loaded node.
SLOWEST_START_S = 60


@pytest.mark.parametrize("l1", ["1Gi", "64Gi", "512Gi"])
def test_the_startup_probe_outlasts_the_reservation_of_a_large_l1(make_pod, make_kvcache, l1):
    out = injected(make_pod(CACHE), make_kvcache(l1={"size": l1}))
    sidecar = container(out, SIDECAR)
    startup = sidecar["startupProbe"]
    # The kubelet kills the sidecar after failureThreshold failed probes, one
    # per period; liveness and readiness probes wait for startup to succeed,
    # so this is the whole budget of a starting sidecar.
    budget_s = startup["failureThreshold"] * startup.get("periodSeconds", 10)
    needed_s = SLOWEST_START_S + math.ceil(parse_quantity(l1) / GIB / SLOWEST_RESERVE_GIB_PER_S)
    assert budget_s >= needed_s, (budget_s, needed_s)
    assert startup["httpGet"]["path"] == "/readyz"  # ready only once the arena is reserved
    # A liveness probe that could fire during startup would restart it; the
    # kubelet holds liveness until startup succeeds, which needs both probes on
    # the sidecar's one port.
    assert sidecar["livenessProbe"]["httpGet"]["port"] == startup["httpGet"]["port"]
    ports = {p["name"] for p in sidecar["ports"]}
    assert startup["httpGet"]["port"] in ports
