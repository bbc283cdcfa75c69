"""The admission mutation: what an injected pod looks like, idempotency, and every skip path."""

from __future__ import annotations

import copy
import json
import types

import jsonpatch
import kopf
import pytest

from kvstrata.operator import handlers
from kvstrata.operator import spec as S
from kvstrata.operator.mutate import mutate_pod, transfer_config
from kvstrata.operator.sidecar_container import INSTALLER, SIDECAR
from kvstrata.testing.poll import wait_until

CACHE = {S.CACHE_ANNOTATION: "demo"}
EXPECTED_FLAG = {
    "kv_connector": "KVStrataConnector",
    "kv_connector_module_path": "kvstrata.connector",
    "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute",
    "kv_connector_extra_config": {
        "endpoint": "ipc:///var/run/kvstrata/sidecar.sock",
        "call_timeout_seconds": 0.5,
    },
}


def applied(pod, result):
    return jsonpatch.apply_patch(copy.deepcopy(pod), result.patch)


def container(pod, name):
    everything = pod["spec"].get("initContainers", []) + pod["spec"]["containers"]
    return next(c for c in everything if c["name"] == name)


def env_of(c):
    return {e["name"]: e.get("value") for e in c.get("env", [])}


def mounts_of(c):
    return {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}


def test_a_pod_without_the_annotation_gets_no_patch(make_pod, make_kvcache):
    assert mutate_pod(make_pod(), make_kvcache()).patch == []


def test_an_annotated_pod_gets_a_native_sidecar_that_starts_before_vllm(
    make_pod, make_kvcache, k8s_valid
):
    pod = make_pod(CACHE)
    result = mutate_pod(pod, make_kvcache(l1={"size": "2Gi"}))
    assert result.injected and result.skipped is None
    out = applied(pod, result)
    k8s_valid(out)
    inits = [c["name"] for c in out["spec"]["initContainers"]]
    assert inits == [INSTALLER, SIDECAR]
    sidecar = container(out, SIDECAR)
    assert sidecar["restartPolicy"] == "Always"
    assert sidecar["command"] == ["kvstrata", "sidecar", "--config", "/etc/kvstrata/sidecar.yaml"]
    assert sidecar["startupProbe"]["httpGet"]["path"] == "/readyz"
    assert sidecar["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert sidecar["ports"][0]["containerPort"] == 9464
    assert sidecar["resources"]["limits"]["memory"] == "2560Mi"  # L1 + 512Mi
    assert sidecar["securityContext"]["readOnlyRootFilesystem"] is True
    assert mounts_of(sidecar)["/etc/kvstrata"] == "kvstrata-config"
    volumes = {v["name"]: v for v in out["spec"]["volumes"]}
    assert volumes["kvstrata-config"]["configMap"]["name"] == "demo-sidecar"
    assert volumes["kvstrata-shm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "2509Mi"}
    vllm = container(out, "vllm")
    assert mounts_of(vllm)["/dev/shm"] == mounts_of(sidecar)["/dev/shm"] == "kvstrata-shm"
    assert mounts_of(vllm)[S.SOCKET_DIR] == mounts_of(sidecar)[S.SOCKET_DIR] == "kvstrata-socket"
    assert env_of(vllm)["PYTHONHASHSEED"] == "0"
    assert env_of(vllm)["PYTHONPATH"] == S.PYTHON_DIR
    assert vllm["args"][:2] == ["--model", "Qwen/Qwen2.5-0.5B"]
    assert vllm["args"][-2] == "--kv-transfer-config"
    assert json.loads(vllm["args"][-1]) == EXPECTED_FLAG == transfer_config()
    assert out["metadata"]["labels"][S.CACHE_LABEL] == "demo"
    assert len(out["metadata"]["annotations"][S.INJECTED_ANNOTATION]) == 16


def test_mutating_an_injected_pod_again_changes_nothing(make_pod, make_kvcache):
    pod = make_pod(CACHE)
    kvcache = make_kvcache()
    once = applied(pod, mutate_pod(pod, kvcache))
    assert mutate_pod(once, kvcache).patch == []
    assert mutate_pod(once, make_kvcache(l1={"size": "8Gi"})).patch == []


@pytest.mark.parametrize(
    ("annotations", "containers", "kvcache", "reason"),
    [
        (CACHE, None, None, "KVCache ml/demo not found"),
        ({S.CACHE_ANNOTATION: "Not_A_Name!"}, None, {}, "bad annotation kvstrata.io/cache"),
        ({S.CACHE_ANNOTATION: ""}, None, {}, "bad annotation kvstrata.io/cache"),
        ({**CACHE, S.VLLM_CONTAINER_ANNOTATION: "engine"}, None, {}, "container 'engine'"),
        (CACHE, [], {}, "the pod has no containers"),
        (CACHE, None, {"l1": {"size": "1Ki"}}, "invalid spec: invalid sidecar config"),
        (
            CACHE,
            [{"name": "vllm", "image": "v", "args": ["--kv-transfer-config", "{}"]}],
            {},
            "already sets --kv-transfer-config",
        ),
    ],
    ids=[
        "no-kvcache",
        "bad-name",
        "empty-name",
        "named-container-missing",
        "no-containers",
        "invalid-spec",
        "already-configured",
    ],
)
def test_a_pod_that_cannot_be_injected_is_left_unchanged_with_a_reason(
    annotations, containers, kvcache, reason, make_pod, make_kvcache
):
    pod = make_pod(annotations, containers)
    result = mutate_pod(pod, None if kvcache is None else make_kvcache(**kvcache))
    assert not result.injected
    assert reason in result.skipped
    out = applied(pod, result)
    assert out["metadata"]["annotations"].pop(S.SKIPPED_ANNOTATION) == result.skipped
    assert out == pod
    assert mutate_pod(applied(pod, result), make_kvcache()).patch == []


def test_the_vllm_container_is_the_annotated_one_then_the_one_running_vllm(make_pod, make_kvcache):
    proxy = {"name": "proxy", "image": "envoy"}
    engine = {
        "name": "engine",
        "image": "img",
        "command": ["python3", "-m", "vllm.entrypoints.openai.api_server"],
    }
    other = {"name": "other", "image": "img"}
    kvcache = make_kvcache()
    pod = make_pod(CACHE, [proxy, engine])
    assert "args" in container(applied(pod, mutate_pod(pod, kvcache)), "engine")
    pod = make_pod({**CACHE, S.VLLM_CONTAINER_ANNOTATION: "other"}, [proxy, engine, other])
    out = applied(pod, mutate_pod(pod, kvcache))
    assert "--kv-transfer-config" in container(out, "other")["args"]
    assert "args" not in container(out, "engine")
    pod = make_pod(CACHE, [proxy, other])
    assert (
        "--kv-transfer-config" in container(applied(pod, mutate_pod(pod, kvcache)), "proxy")["args"]
    )


def test_a_shell_command_gets_the_flag_appended_to_its_script(make_pod, make_kvcache):
    c = {"name": "vllm", "image": "v", "command": ["/bin/sh", "-c"], "args": ["exec vllm serve m"]}
    pod = make_pod(CACHE, [c])
    out = container(applied(pod, mutate_pod(pod, make_kvcache())), "vllm")
    assert out["command"] == ["/bin/sh", "-c"]
    script = out["args"][0]
    assert script.startswith("exec vllm serve m --kv-transfer-config '")
    assert json.loads(script.split("'")[1]) == EXPECTED_FLAG
    inline = {"name": "vllm", "image": "v", "command": ["bash", "-c", "vllm serve m"]}
    pod = make_pod(CACHE, [inline])
    out = container(applied(pod, mutate_pod(pod, make_kvcache())), "vllm")
    assert out["command"][2].startswith("vllm serve m --kv-transfer-config '")
    assert "args" not in out


def test_existing_shm_pythonpath_and_hash_seed_are_respected(make_pod, make_kvcache):
    c = {
        "name": "vllm",
        "image": "v",
        "env": [{"name": "PYTHONHASHSEED", "value": "42"}, {"name": "PYTHONPATH", "value": "/app"}],
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm/"}],
    }
    pod = make_pod(CACHE, [c], volumes=[{"name": "dshm", "emptyDir": {"medium": "Memory"}}])
    out = applied(pod, mutate_pod(pod, make_kvcache()))
    vllm = container(out, "vllm")
    assert env_of(vllm)["PYTHONHASHSEED"] == "42"
    assert env_of(vllm)["PYTHONPATH"] == f"{S.PYTHON_DIR}:/app"
    assert mounts_of(container(out, SIDECAR))["/dev/shm"] == "dshm"
    assert "kvstrata-shm" not in {v["name"] for v in out["spec"]["volumes"]}
    assert sum(1 for m in vllm["volumeMounts"] if m["mountPath"].rstrip("/") == "/dev/shm") == 1


def test_an_image_that_ships_kvstrata_gets_no_installer(make_pod, make_kvcache):
    pod = make_pod({**CACHE, S.INJECT_PACKAGE_ANNOTATION: "false"})
    out = applied(pod, mutate_pod(pod, make_kvcache()))
    assert [c["name"] for c in out["spec"]["initContainers"]] == [SIDECAR]
    assert "PYTHONPATH" not in env_of(container(out, "vllm"))


@pytest.mark.parametrize(
    ("mode", "vllm_extra", "expected"),
    [
        ("auto", {"resources": {"limits": {"nvidia.com/gpu": 1}}}, "all"),
        ("ipc", {"env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "GPU-1234"}]}, "GPU-1234"),
        ("host", {"resources": {"limits": {"nvidia.com/gpu": 1}}}, None),
        ("auto", {}, None),
    ],
)
def test_the_sidecar_sees_the_vllm_gpu_in_ipc_mode(
    mode, vllm_extra, expected, make_pod, make_kvcache
):
    pod = make_pod(CACHE, [{"name": "vllm", "image": "v", **vllm_extra}])
    out = applied(pod, mutate_pod(pod, make_kvcache(transferMode=mode)))
    assert env_of(container(out, SIDECAR)).get("NVIDIA_VISIBLE_DEVICES") == expected


SHARED = {
    "valkey-managed": {"backend": "valkey", "valkey": {"managed": {}}},
    "valkey-external": {
        "backend": "valkey",
        "valkey": {
            "external": {
                "url": "rediss://v:6380",
                "passwordSecretRef": {"name": "pw", "key": "secret"},
                "tls": {"caSecretRef": {"name": "ca"}},
            }
        },
    },
    "s3": {"backend": "s3", "s3": {"bucket": "b", "credentialsSecretRef": {"name": "creds"}}},
}


@pytest.mark.parametrize("shared", SHARED.values(), ids=SHARED.keys())
def test_every_file_the_config_names_is_mounted_in_the_sidecar(
    shared, make_pod, make_kvcache, k8s_valid
):
    kvcache = make_kvcache(
        shared=shared, l2={"volume": {"type": "ephemeral", "storageClassName": "ssd"}}
    )
    config, _ = S.render_sidecar_config(kvcache)
    pod = make_pod(CACHE)
    out = applied(pod, mutate_pod(pod, kvcache))
    k8s_valid(out)
    mounts = mounts_of(container(out, SIDECAR))
    section = config.shared.valkey if shared["backend"] == "valkey" else config.shared.s3
    files = [v for k, v in section.model_dump().items() if k.endswith("_file") and v]
    assert files
    for path in [*files, config.l2.path, S.CONFIG_PATH]:
        assert any(path.startswith(m + "/") or path == m for m in mounts), path
    l2 = next(v for v in out["spec"]["volumes"] if v["name"] == "kvstrata-l2")
    assert l2["ephemeral"]["volumeClaimTemplate"]["spec"]["storageClassName"] == "ssd"


def test_the_sidecar_runs_as_the_vllm_user(make_pod, make_kvcache):
    pod = make_pod(CACHE, securityContext={"runAsUser": 1000, "runAsGroup": 1000})
    ctx = container(applied(pod, mutate_pod(pod, make_kvcache())), SIDECAR)["securityContext"]
    assert (ctx["runAsUser"], ctx["runAsGroup"], ctx["runAsNonRoot"]) == (1000, 1000, True)


def _admission_body(pod):
    return kopf.Body(copy.deepcopy(pod))


def _events(cluster) -> list[dict]:
    """The Events the webhook posted to ``cluster``, as the API server would hold them."""
    return [
        {k: e[k] for k in ("type", "reason", "message")}
        for (_, kind, _, _), e in cluster.objects.items()
        if kind == "Event"
    ]


def _run_webhook_handler(pod: dict, cluster) -> dict:
    """Run our kopf admission handler on ``pod``: the patched pod."""
    memo = types.SimpleNamespace(cluster=cluster)
    body = _admission_body(pod)
    patch = kopf.Patch(body=body)
    handlers.inject_sidecar(body=body, patch=patch, memo=memo, logger=handlers.logger)
    return jsonpatch.apply_patch(copy.deepcopy(pod), patch.as_json_patch())


def test_the_webhook_handler_returns_the_same_mutation_through_kopf(
    make_pod, make_kvcache, cluster
):
    cluster.put(make_kvcache())
    pod = make_pod(CACHE)
    via_kopf = _run_webhook_handler(pod, cluster)
    assert via_kopf == applied(
        pod, mutate_pod(pod, cluster.get(S.API_VERSION, S.KIND, "ml", "demo"))
    )
    assert _events(cluster) == []


def test_the_webhook_handler_skips_with_an_event_when_the_kvcache_is_missing(make_pod, cluster):
    pod = make_pod(CACHE)
    out = _run_webhook_handler(pod, cluster)
    assert out["metadata"]["annotations"][S.SKIPPED_ANNOTATION] == "KVCache ml/demo not found"
    # Posted on a thread of its own, after the answer.
    events = wait_until(lambda: _events(cluster), 30, "the InjectionSkipped Event")
    assert events == [
        {"type": "Warning", "reason": "InjectionSkipped", "message": "KVCache ml/demo not found"}
    ]


class FaultInjectingCluster:
    """An API server that fails every read: the one fault a test cannot cause with a dict."""

    def get(self, *args, **kwargs):
        raise ConnectionError("apiserver unreachable")


def test_an_api_failure_in_the_webhook_still_admits_the_pod(make_pod):
    memo = types.SimpleNamespace(cluster=FaultInjectingCluster())
    pod = make_pod(CACHE)
    body = _admission_body(pod)
    patch = kopf.Patch(body=body)
    handlers.inject_sidecar(body=body, patch=patch, memo=memo, logger=handlers.logger)
    out = jsonpatch.apply_patch(copy.deepcopy(pod), patch.as_json_patch())
    reason = out["metadata"]["annotations"][S.SKIPPED_ANNOTATION]
    assert reason == "cannot read KVCache ml/demo: apiserver unreachable"
    assert out["spec"] == pod["spec"]


@pytest.mark.parametrize(
    ("mode", "vllm_extra", "shared"),
    [
        ("ipc", {"resources": {"limits": {"nvidia.com/gpu": 1}}}, True),
        ("auto", {"resources": {"limits": {"nvidia.com/gpu": 1}}}, True),
        ("ipc", {"env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "GPU-1234"}]}, True),
        ("host", {"resources": {"limits": {"nvidia.com/gpu": 1}}}, None),
        ("auto", {}, None),
    ],
)
def test_a_pod_whose_sidecar_can_use_ipc_shares_one_process_namespace(
    mode, vllm_extra, shared, make_pod, make_kvcache
):
    # CUDA IPC handles and interprocess events do not open across PID
    # namespaces; a Pod's containers have one each unless it shares them.
    pod = make_pod(CACHE, [{"name": "vllm", "image": "v", **vllm_extra}])
    out = applied(pod, mutate_pod(pod, make_kvcache(transferMode=mode)))
    assert out["spec"].get("shareProcessNamespace") is shared


def test_a_pod_that_refuses_a_shared_process_namespace_keeps_its_choice(make_pod, make_kvcache):
    pod = make_pod(
        CACHE, [{"name": "vllm", "image": "v", "resources": {"limits": {"nvidia.com/gpu": 1}}}]
    )
    pod["spec"]["shareProcessNamespace"] = False
    out = applied(pod, mutate_pod(pod, make_kvcache(transferMode="ipc")))
    assert out["spec"]["shareProcessNamespace"] is False


def test_the_vllm_container_gets_the_params_check_unless_it_has_logits_processors(
    make_pod, make_kvcache
):
    """A bad kv_transfer_params is answered with a 400 only where vLLM loads the
    connector's check (kvstrata.connector.params_check); a container with its
    own --logits-processors keeps its list untouched."""
    check = "kvstrata.connector.params_check:KVStrataParamsCheck"
    pod = make_pod(CACHE, [{"name": "vllm", "image": "v", "args": ["--model", "m"]}])
    args = container(applied(pod, mutate_pod(pod, make_kvcache())), "vllm")["args"]
    assert args[args.index("--logits-processors") + 1] == check
    own = {"name": "vllm", "image": "v", "args": ["--logits-processors", "my.mod:Proc"]}
    pod = make_pod(CACHE, [own])
    own_args = container(applied(pod, mutate_pod(pod, make_kvcache())), "vllm")["args"]
    assert own_args.count("--logits-processors") == 1
    assert own_args[own_args.index("--logits-processors") + 1] == "my.mod:Proc"
    script = {"name": "vllm", "image": "v", "command": ["sh", "-c", "exec vllm serve m"]}
    pod = make_pod(CACHE, [script])
    line = container(applied(pod, mutate_pod(pod, make_kvcache())), "vllm")["command"][2]
    assert line.endswith(f" --logits-processors {check}")
