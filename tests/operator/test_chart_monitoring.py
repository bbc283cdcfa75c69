"""The chart's monitoring objects: one recommended ServiceMonitor for the
sidecars that honours ``operator.watchNamespaces`` and labels series by KVCache,
the per-KVCache one labelling them the same way, and the PrometheusRule.

The alerts' expressions themselves are evaluated by a real Prometheus in
tests/integration/sidecar/observability/test_alert_rules.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

helm = pytest.importorskip("helm_python")

from kvstrata.operator.resources import render_metrics_objects  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "kvstrata"


def render(values: dict[str, Any]) -> list[dict[str, Any]]:
    manifests = helm.Chart.load(CHART).render(values=values, name="kvs", namespace="kvs-system")
    return [
        d for name, text in manifests.items() if name.endswith(".yaml")
        for d in yaml.safe_load_all(text) if d
    ]  # fmt: skip


def sidecar_monitor(values: dict[str, Any]) -> dict[str, Any]:
    values = {**values, "monitoring": {"serviceMonitor": {"enabled": True}}}
    (monitor,) = [d for d in render(values) if d["metadata"]["name"] == "kvs-kvstrata-sidecars"]
    return monitor


def test_the_sidecars_servicemonitor_watches_only_the_watched_namespaces():
    watched = sidecar_monitor({"operator": {"watchNamespaces": ["ml", "team-b"]}})
    assert watched["spec"]["namespaceSelector"] == {"matchNames": ["ml", "team-b"]}
    assert sidecar_monitor({})["spec"]["namespaceSelector"] == {"any": True}


def test_both_servicemonitors_label_each_series_with_its_kvcache():
    relabel = {"sourceLabels": ["__meta_kubernetes_pod_label_kvstrata_io_cache"],
               "targetLabel": "kvcache"}  # fmt: skip
    (endpoint,) = sidecar_monitor({})["spec"]["endpoints"]
    assert relabel in endpoint["relabelings"]
    kvcache = {"metadata": {"name": "qc", "namespace": "ml", "uid": "u"},
               "spec": {"metrics": {"serviceMonitor": {"enabled": True}}}}  # fmt: skip
    (_, own) = render_metrics_objects(kvcache)
    assert relabel in own["spec"]["endpoints"][0]["relabelings"]


def test_no_example_turns_on_the_per_kvcache_servicemonitor_the_chart_one_duplicates():
    for path in (REPO / "examples").rglob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "KVCache":
                monitor = (doc["spec"].get("metrics") or {}).get("serviceMonitor") or {}
                assert not monitor.get("enabled"), path.name


def test_the_prometheusrule_is_rendered_only_when_asked_for_with_four_alerts():
    assert not [d for d in render({}) if d["kind"] == "PrometheusRule"]
    values = {"monitoring": {"prometheusRule": {"enabled": True, "labels": {"release": "kps"}}}}
    (rule,) = [d for d in render(values) if d["kind"] == "PrometheusRule"]
    assert rule["metadata"]["labels"]["release"] == "kps"
    names = [r["alert"] for g in rule["spec"]["groups"] for r in g["rules"]]
    assert names == [
        "KVStrataTierDegraded",
        "KVStrataStoresRefused",
        "KVStrataSidecarRestartLoop",
        "KVStrataHitRateFalling",
    ]
    for r in rule["spec"]["groups"][0]["rules"]:
        assert "{{ $labels." in r["annotations"]["summary"]  # Prometheus's, not Helm's, template


def test_helm_refuses_a_malformed_alert_window():
    with pytest.raises(helm.HelmError, match="schema"):
        render({"monitoring": {"prometheusRule": {"enabled": True, "window": "soon"}}})


def operator_images(values: dict[str, Any]) -> dict[str, str]:
    (deployment,) = [d for d in render(values) if d["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    images = {"operator": container["image"]}
    for env in container["env"]:
        if env["name"].endswith("_IMAGE"):
            images[env["name"]] = env["value"]
    return images


def test_a_global_image_registry_replaces_every_images_registry_and_keeps_the_paths():
    default = operator_images({})
    mirrored = operator_images({"global": {"imageRegistry": "mirror.example.com:5000/ml"}})
    assert default.keys() == mirrored.keys() and len(mirrored) == 5
    assert mirrored["operator"] == "mirror.example.com:5000/ml/kvstrata/kvstrata-operator:0.1.0"
    valkey = mirrored["KVSTRATA_OPERATOR_VALKEY_IMAGE"]
    assert valkey.startswith("mirror.example.com:5000/ml/valkey/")
    for name, image in mirrored.items():
        host, path = default[name].split("/", 1)
        assert image == f"mirror.example.com:5000/ml/{path}", (name, host)


def test_an_image_repository_without_a_registry_is_prefixed_whole():
    values = {"global": {"imageRegistry": "mirror.local"}, "image": {"repository": "team/op"}}
    assert operator_images(values)["operator"] == "mirror.local/team/op:0.1.0"
