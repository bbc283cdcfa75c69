"""``python -m kvstrata.chartpackage [DIR]``: the Helm chart packaged for a registry.

Why: a platform team installs charts from its own registry, not from a
checkout. This writes, into ``DIR`` (``dist/`` by default):

* ``kvstrata-VERSION.tgz``: what ``helm package charts/kvstrata`` makes (Helm's
  own packager, through the Helm library the tests already use: no ``helm``
  binary needed); ``helm push kvstrata-VERSION.tgz oci://REGISTRY/charts`` uploads it;
* ``kvstrata-oci/``: the same chart as an OCI image layout (the artifact Helm
  pushes to an OCI registry: a config blob holding the chart's metadata and a
  layer holding the archive), for tools that copy layouts, e.g.
  ``oras cp --from-oci-layout dist/kvstrata-oci:VERSION REGISTRY/charts/kvstrata:VERSION``.

The layout, as written::

    kvstrata-oci/oci-layout          {"imageLayoutVersion": "1.0.0"}
    kvstrata-oci/index.json          one manifest, ref.name = the chart version
    kvstrata-oci/blobs/sha256/<hex>  the manifest, the config (Chart.yaml as JSON), the .tgz
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import yaml

CHART = Path(__file__).resolve().parents[2] / "charts" / "kvstrata"
CONFIG_TYPE = "application/vnd.cncf.helm.config.v1+json"
CHART_TYPE = "application/vnd.cncf.helm.chart.content.v1.tar+gzip"
MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"


def package(chart: Path, destination: Path) -> Path:
    """``helm package``: the chart's ``.tgz`` in ``destination``."""
    import helm_python

    destination.mkdir(parents=True, exist_ok=True)
    return Path(helm_python.package(chart, destination=destination))


def _blob(layout: Path, data: bytes, media_type: str) -> dict[str, Any]:
    """Store ``data`` under its digest; its OCI descriptor."""
    digest = hashlib.sha256(data).hexdigest()
    (layout / "blobs" / "sha256" / digest).write_bytes(data)
    return {"mediaType": media_type, "digest": f"sha256:{digest}", "size": len(data)}


def oci_layout(archive: Path, chart: Path, layout: Path) -> dict[str, Any]:
    """Write ``archive`` as a Helm chart artifact in an OCI image layout; its index."""
    metadata = yaml.safe_load((chart / "Chart.yaml").read_text())
    if layout.exists():
        shutil.rmtree(layout)
    (layout / "blobs" / "sha256").mkdir(parents=True)
    config = _blob(layout, json.dumps(metadata, sort_keys=True).encode(), CONFIG_TYPE)
    content = _blob(layout, archive.read_bytes(), CHART_TYPE)
    manifest = {
        "schemaVersion": 2,
        "mediaType": MANIFEST_TYPE,
        "config": config,
        "layers": [content],
        "annotations": {
            "org.opencontainers.image.title": metadata["name"],
            "org.opencontainers.image.version": metadata["version"],
            "org.opencontainers.image.description": metadata.get("description", ""),
        },
    }
    entry = _blob(layout, json.dumps(manifest, sort_keys=True).encode(), MANIFEST_TYPE)
    entry["annotations"] = {"org.opencontainers.image.ref.name": metadata["version"]}
    index = {"schemaVersion": 2, "manifests": [entry]}
    (layout / "index.json").write_text(json.dumps(index, indent=2) + "\n")
    (layout / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}) + "\n")
    return index


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    destination = Path(args[0] if args else "dist")
    archive = package(CHART, destination)
    oci_layout(archive, CHART, destination / "kvstrata-oci")
    print(f"wrote {archive} and {destination / 'kvstrata-oci'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
