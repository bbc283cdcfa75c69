"""Reference pages generated from the code they describe.

Why: a table written by hand beside the code drifts from it. Each page here
is rendered from its source by ``make docs`` (``python -m kvstrata.refdocs``)
and ``tests/unit/test_reference_docs.py`` fails when a committed page differs
from what its source renders now. :data:`PAGES` maps each page (a path from
the repository root) to its renderer; the sources are named in each renderer's
module.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from kvstrata import metricsdoc
from kvstrata.refdocs import architecture, chart, configuration, connector, kvcache, protocol

REPO = Path(__file__).resolve().parents[3]

PAGES: dict[str, Callable[[Path], str]] = {
    "docs/metrics.md": lambda _repo: metricsdoc.render(),
    "docs/protocol.md": lambda _repo: protocol.render(),
    "docs/configuration.md": lambda _repo: configuration.render(),
    "docs/connector.md": lambda _repo: connector.render(),
    "docs/kvcache.md": kvcache.render,
    "charts/kvstrata/README.md": chart.render,
    "charts/kvstrata/crds/kvcache.yaml": kvcache.chart_copy,
    # Its module table only: the rest of that page is written by hand.
    architecture.PAGE: architecture.render,
    # kopf's peering kinds, for operator.replicas above 1: shipped unchanged as well.
    "charts/kvstrata/crds/kopfpeering.yaml": lambda repo: (
        repo / "crds/kopfpeering.yaml"
    ).read_text(),
}
