"""examples/quickstart/: a stock vLLM Deployment on a GPU with one annotation added,
and the pod the webhook makes of it, as the README's quick start walks through."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import jsonpatch
import yaml

from kvstrata.operator import reconcile as rec
from kvstrata.operator import spec as S
from kvstrata.operator.mutate import mutate_pod
from kvstrata.operator.sidecar_container import INSTALLER, SIDECAR

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "examples" / "quickstart"


def docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((QUICKSTART / name).read_text()) if d]


def kvcache() -> dict[str, Any]:
    (doc,) = docs("kvcache.yaml")
    doc = copy.deepcopy(doc)
    doc["metadata"].update(namespace="default", uid="u", generation=1)
    return doc


def pod_of(deployment: dict[str, Any]) -> dict[str, Any]:
    template = copy.deepcopy(deployment["spec"]["template"])
    meta = dict(template["metadata"], name="qwen-0", namespace="default")
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": template["spec"]}


def test_the_quickstart_deployment_is_stock_vllm_but_for_the_cache_annotation(k8s_valid):
    deployment, service = docs("vllm.yaml")
    k8s_valid(deployment)
    k8s_valid(service)
    template = deployment["spec"]["template"]
    assert template["metadata"]["annotations"] == {S.CACHE_ANNOTATION: "quickstart"}
    (vllm,) = template["spec"]["containers"]
    assert vllm["image"].startswith("vllm/vllm-openai:")
    assert vllm["resources"]["limits"]["nvidia.com/gpu"] == 1
    spec_text = json.dumps(template["spec"])
    for word in (
        "kvstrata",
        "kv-transfer-config",
        "PYTHONPATH",
        "PYTHONHASHSEED",
        "initContainers",
    ):
        assert word not in spec_text, word


def test_the_webhook_gives_the_quickstart_pod_the_cuda_sidecar_and_the_connector(
    k8s_valid, cluster
):
    cache = kvcache()
    objects, _, _ = rec.desired_objects(cache, cluster)  # rendered through the sidecar's loader
    for obj in objects:
        k8s_valid(obj)
    deployment, _ = docs("vllm.yaml")
    pod = pod_of(deployment)
    result = mutate_pod(pod, cache, images=S.Images())
    assert result.injected, result.skipped
    out = jsonpatch.apply_patch(pod, result.patch)
    k8s_valid(out)

    init = {c["name"]: c for c in out["spec"]["initContainers"]}
    assert init[SIDECAR]["image"] == S.Images().sidecar_cuda.ref
    assert init[INSTALLER]["image"] == S.Images().installer.ref
    assert init[INSTALLER]["command"] == ["python", "-m", "kvstrata.operator.install", S.PYTHON_DIR]
    (vllm,) = out["spec"]["containers"]
    assert vllm["args"][-2] == "--kv-transfer-config"
    transfer = json.loads(vllm["args"][-1])
    assert (transfer["kv_connector"], transfer["kv_connector_module_path"]) == (
        "KVStrataConnector",
        "kvstrata.connector",
    )
    env = {e["name"]: e.get("value") for e in vllm["env"]}
    assert env["PYTHONPATH"] == S.PYTHON_DIR and env["PYTHONHASHSEED"] == "0"


def test_the_readme_quick_start_names_files_and_make_targets_that_exist():
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Quick start on Kubernetes", 1)[1].split("\n## ", 1)[0]
    paths = set(re.findall(r"examples/quickstart/[\w.-]+", section))
    assert paths == {"examples/quickstart/kvcache.yaml", "examples/quickstart/vllm.yaml"}
    makefile = (REPO / "Makefile").read_text()
    # A target is a whole lower-case word: "make vLLM forget" names none.
    for target in set(re.findall(r"\bmake ([a-z-]+)(?![A-Za-z])", section)):
        assert re.search(rf"^{target}:", makefile, re.M), target
