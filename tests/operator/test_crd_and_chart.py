"""The CRD, the examples and the Helm chart, checked without a cluster or helm.

(What the API server itself checks of the CRD is in test_crd_as_the_api_server_sees_it.)

``helm`` is not installable here from Debian or PyPI, so the chart is checked
by what can be checked without rendering templates: values against
values.schema.json, a ``## @param`` for every value, every ``.Values`` path a
template reads exists, every ``include`` is defined, the CRD copy is
byte-identical, the dashboard queries the sidecar's metric names.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from kvstrata.operator import reconcile as rec
from kvstrata.operator.mutate import mutate_pod

from .apiserver import to_json_schema

REPO = Path(__file__).resolve().parents[2]
CRD = REPO / "crds" / "kvcache.yaml"
CHART = REPO / "charts" / "kvstrata"
EXAMPLES = REPO / "examples"


def crd() -> dict[str, Any]:
    return yaml.safe_load(CRD.read_text())


def kvcache_validator() -> jsonschema.Draft7Validator:
    schema = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return jsonschema.Draft7Validator(to_json_schema(schema))


def test_the_chart_ships_the_same_crd_byte_for_byte():
    assert (CHART / "crds" / "kvcache.yaml").read_bytes() == CRD.read_bytes()


# The names AIBrix's KVCache CRD (kvcaches.orchestration.aibrix.ai) registers:
# plural and singular only, no short names or categories
# (vllm-project/aibrix, config/crd/orchestration/orchestration.aibrix.ai_kvcaches.yaml).
OTHER_KVCACHE_NAMES = {"kvcaches", "kvcache"}


def test_kubectl_can_name_our_kvcache_unambiguously_beside_another_kvcache_kind():
    """``kubectl get kvcache`` is ambiguous with AIBrix installed; the short name,
    the category and the full name are ours alone."""
    doc = crd()
    names = doc["spec"]["names"]
    assert names["categories"] == ["kvstrata"]
    assert not set(names["shortNames"]) & OTHER_KVCACHE_NAMES
    assert not set(names["categories"]) & OTHER_KVCACHE_NAMES
    assert doc["metadata"]["name"] == "kvcaches.kvstrata.io"
    reference = (REPO / "docs" / "kvcache.md").read_text()
    assert "`kvcaches.kvstrata.io`" in reference and "`kubectl get kvstrata`" in reference


def test_the_crd_is_a_valid_customresourcedefinition(k8s_valid):
    doc = crd()
    k8s_valid(doc)
    names = doc["spec"]["names"]
    assert (names["kind"], names["plural"], names["shortNames"]) == ("KVCache", "kvcaches", ["kvc"])
    version = doc["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}}
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns == ["Ready", "Shared tier", "L1", "L2", "Pods", "Age"]


def example_docs(kind: str) -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for path in sorted(EXAMPLES.glob("*.yaml")):
        docs += [(path.name, d) for d in yaml.safe_load_all(path.read_text()) if d["kind"] == kind]
    return docs


def test_there_is_an_example_per_shared_tier():
    kinds = {rec.S.shared_tier_kind(d["spec"]) for _, d in example_docs("KVCache")}
    assert kinds == {"none", "valkey-managed", "valkey-external", "s3"}


@pytest.mark.parametrize(
    ("name", "doc"), example_docs("KVCache"), ids=lambda v: v if isinstance(v, str) else ""
)
def test_example_kvcaches_match_the_crd_and_render(name, doc, cluster, k8s_valid):
    kvcache_validator().validate(doc)
    kvcache = copy.deepcopy(doc)
    kvcache["metadata"].update(namespace="ml", uid="u")
    objects, _, _ = rec.desired_objects(kvcache, cluster)
    for obj in objects:
        if obj["kind"] != "ServiceMonitor":
            k8s_valid(obj)


@pytest.mark.parametrize(
    "spec",
    [
        {"l1": {"policy": "mru"}},
        {"l1": {"size": "lots"}},
        {"shared": {"codec": "gzip"}},
        {"transferMode": "rdma"},
        {"shared": {"valkey": {"external": {"url": "http://x"}}}},
    ],
)
def test_the_crd_refuses_bad_enums_and_quantities(spec):
    doc = {"apiVersion": "kvstrata.io/v1alpha1", "kind": "KVCache", "metadata": {}, "spec": spec}
    assert list(kvcache_validator().iter_errors(doc))


def test_the_example_vllm_deployment_gets_a_valid_injected_pod(k8s_valid):
    ((_, deployment),) = example_docs("Deployment")
    k8s_valid(deployment)
    template = deployment["spec"]["template"]
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": dict(template["metadata"], namespace="ml"),
        "spec": template["spec"],
    }
    ((_, shared),) = [d for d in example_docs("KVCache") if d[1]["metadata"]["name"] == "shared"]
    kvcache = dict(shared, metadata={**shared["metadata"], "namespace": "ml"})
    import jsonpatch

    result = mutate_pod(pod, kvcache)
    assert result.injected
    out = jsonpatch.apply_patch(pod, result.patch)
    k8s_valid(out)
    sidecar = out["spec"]["initContainers"][-1]
    assert {e["name"]: e["value"] for e in sidecar["env"]}["NVIDIA_VISIBLE_DEVICES"] == "all"


# -- the Helm chart -------------------------------------------------------------


def values() -> dict[str, Any]:
    return yaml.safe_load((CHART / "values.yaml").read_text())


def leaves(node: Any, prefix: str = "") -> list[str]:
    if isinstance(node, dict) and node:
        return [p for k, v in node.items() for p in leaves(v, f"{prefix}.{k}" if prefix else k)]
    return [prefix]


def test_default_values_match_the_values_schema():
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    jsonschema.Draft7Validator(schema).validate(values())


@pytest.mark.parametrize(
    "override",
    [
        {"webhook": {"failurePolicy": "Fail"}},
        {"image": {"pullPolicy": "Sometimes"}},
        {"operator": {"replicas": -1}},
        {"webhook": {"timeoutSeconds": 60}},
        {"monitoring": {"serviceMonitor": {"enabled": "yes"}}},
    ],
)
def test_the_values_schema_refuses_unsafe_or_mistyped_values(override):
    schema = json.loads((CHART / "values.schema.json").read_text())
    merged = values()
    for key, value in override.items():
        merged[key] = {**merged[key], **value} if isinstance(value, dict) else value
    assert list(jsonschema.Draft7Validator(schema).iter_errors(merged))


def test_every_value_is_documented_with_a_param_line():
    documented = set(
        re.findall(r"^\s*## @param (\S+) \S", (CHART / "values.yaml").read_text(), re.M)
    )
    for leaf in leaves(values()):
        parts = leaf.split(".")
        prefixes = {".".join(parts[: i + 1]) for i in range(len(parts))}
        assert prefixes & documented, f"{leaf} has no ## @param line"
    schema = json.loads((CHART / "values.schema.json").read_text())
    for param in documented:
        node = schema
        for part in param.split("."):
            node = node["properties"][part]
        assert node.get("description"), f"{param} has no description in values.schema.json"


def templates() -> dict[str, str]:
    return {p.name: p.read_text() for p in (CHART / "templates").iterdir()}


def test_every_value_a_template_reads_exists():
    known = set()
    for leaf in leaves(values()):
        parts = leaf.split(".")
        known |= {".".join(parts[: i + 1]) for i in range(len(parts))}
    for name, text in templates().items():
        for path in re.findall(r"\.Values\.([A-Za-z0-9_.]+)", text):
            assert path.rstrip(".") in known, f"{name} reads .Values.{path}"


def test_every_included_template_is_defined():
    texts = templates()
    defined = set(re.findall(r'define "([^"]+)"', texts["_helpers.tpl"]))
    for name, text in texts.items():
        for used in re.findall(r'include "([^"]+)"', text):
            assert used in defined, f"{name} includes undefined {used}"


def test_template_actions_are_balanced():
    opening = re.compile(r"{{-?\s*(if|with|range|define)\b")
    for name, text in templates().items():
        assert text.count("{{") == text.count("}}"), name
        assert len(opening.findall(text)) == len(re.findall(r"{{-?\s*end\s*-?}}", text)), name


def test_the_webhook_never_blocks_pods_and_every_rbac_rule_says_why():
    texts = templates()
    webhook = texts["webhook.yaml"]
    assert "sideEffects: None" in webhook and "path: /inject" in webhook
    assert "operations: [CREATE]" in webhook and "resources: [pods]" in webhook
    assert values()["webhook"]["failurePolicy"] == "Ignore"
    rules = texts["rbac.yaml"].split("rules:")[1].split("---")[0]
    blocks = re.split(r"\n  - apiGroups", rules)[1:]
    previous = rules.split("\n  - apiGroups")[0]
    for block in blocks:
        assert "#" in previous or block.startswith(": [apps]\n    resources: [deployments]"), block
        previous = block
    assert "'*'" not in rules and '"*"' not in rules


def test_secure_defaults():
    v = values()
    assert v["podSecurityContext"]["runAsNonRoot"] is True
    assert v["securityContext"]["readOnlyRootFilesystem"] is True
    assert v["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert v["securityContext"]["allowPrivilegeEscalation"] is False


METRICS = [
    "kvstrata_lookup_tokens_total",
    "kvstrata_hit_tokens_total",
    "kvstrata_stored_bytes_total",
    "kvstrata_retrieved_bytes_total",
    "kvstrata_tier_usage_bytes",
    "kvstrata_tier_capacity_bytes",
    "kvstrata_operation_duration_seconds_bucket",
    "kvstrata_write_queue_dropped_total",
    "kvstrata_errors_total",
    "kvstrata_tier_degraded",
    "kvstrata_tier_lookup_tokens_total",
    "kvstrata_operator_reconciles_total",
    "kvstrata_operator_reconcile_duration_seconds_bucket",
    "kvstrata_operator_admissions_total",
    "kvstrata_operator_admission_duration_seconds_bucket",
    "kvstrata_operator_managed_valkey_ready",
    "kvstrata_operator_s3_swept_objects_total",
    "kvstrata_tier_server_evicted_keys",
    "kvstrata_tier_refreshed_total",
    "kvstrata_prefetched_bytes_total",
]


def test_the_dashboard_is_grafana_json_over_the_sidecar_metrics():
    dashboard = json.loads((CHART / "dashboards" / "kvstrata.json").read_text())
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p.get("targets", []))
    for metric in METRICS:
        assert metric in exprs, metric
    titles = {p["title"] for p in dashboard["panels"]}
    assert {
        "Hit rate per tier",
        "L1 / L2 usage",
        "Lookup latency",
        "Write-queue drops per tier",
    } <= titles
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    found = set(re.findall(r"kvstrata_[a-z0-9_]+", exprs))
    assert found <= set(METRICS), found - set(METRICS)


def test_non_template_chart_files_parse():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2" and chart["name"] == "kvstrata"
    for path in (CHART / "crds").glob("*.yaml"):
        docs = list(yaml.safe_load_all(path.read_text()))
        assert docs and all(d["kind"] == "CustomResourceDefinition" for d in docs), path.name
