"""``make chart``: the chart as a ``.tgz`` Helm installs and as an OCI image
layout whose every blob is what its digest says."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import yaml

helm = pytest.importorskip("helm_python")

from kvstrata.chartpackage import CHART, CHART_TYPE, CONFIG_TYPE, main  # noqa: E402


def blob(layout: Path, descriptor: dict) -> bytes:
    algorithm, digest = descriptor["digest"].split(":")
    data = (layout / "blobs" / algorithm / digest).read_bytes()
    assert hashlib.sha256(data).hexdigest() == digest and len(data) == descriptor["size"]
    return data


def test_the_packaged_chart_renders_and_its_oci_layout_holds_exactly_it(tmp_path: Path) -> None:
    assert main([str(tmp_path)]) == 0
    version = yaml.safe_load((CHART / "Chart.yaml").read_text())["version"]
    archive = tmp_path / f"kvstrata-{version}.tgz"
    rendered = helm.Chart.load_archive(archive.read_bytes()).render(
        values={}, name="kvs", namespace="ns"
    )
    assert any(name.endswith("deployment.yaml") for name in rendered)

    layout = tmp_path / "kvstrata-oci"
    assert json.loads((layout / "oci-layout").read_text()) == {"imageLayoutVersion": "1.0.0"}
    (entry,) = json.loads((layout / "index.json").read_text())["manifests"]
    assert entry["annotations"]["org.opencontainers.image.ref.name"] == version
    manifest = json.loads(blob(layout, entry))
    assert manifest["config"]["mediaType"] == CONFIG_TYPE
    assert json.loads(blob(layout, manifest["config"]))["version"] == version
    (layer,) = manifest["layers"]
    assert layer["mediaType"] == CHART_TYPE
    assert blob(layout, layer) == archive.read_bytes()
