"""The metric catalogues: docs/metrics.md is current, names follow Prometheus conventions."""

from __future__ import annotations

import re
from pathlib import Path

from kvstrata import metricsdoc
from kvstrata.operator.metrics import CATALOGUE as OPERATOR_CATALOGUE
from kvstrata.sidecar.metrics import CATALOGUE as SIDECAR_CATALOGUE

CATALOGUE = SIDECAR_CATALOGUE + OPERATOR_CATALOGUE

DOC = Path(__file__).parents[3] / "docs" / "metrics.md"


def test_docs_metrics_md_is_rendered_from_the_catalogue():
    assert DOC.read_text() == metricsdoc.render(), "docs/metrics.md is stale: run `make docs`"


def test_names_follow_prometheus_conventions():
    names = [m.name for m in CATALOGUE]
    assert len(names) == len(set(names)), "a metric is listed twice"
    for m in CATALOGUE:
        assert re.fullmatch(r"kvstrata_[a-z0-9_]+", m.name), m.name
        assert m.name.endswith("_total") == (m.type == "counter"), (
            f"{m.name}: counters, and only counters, end in _total"
        )
        if m.unit == "bytes":
            assert "_bytes" in m.name, f"{m.name}: a metric in bytes says so in its name"
        if m.unit == "seconds":
            assert m.name.endswith("_seconds"), f"{m.name}: a duration ends in _seconds"
        for bad in ("_ms", "_milliseconds", "_kb", "_mb", "_kib", "_mib"):
            assert bad not in m.name, f"{m.name}: base units only"
        assert m.help and m.unit, m.name
