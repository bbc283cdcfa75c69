"""``docs/metrics.md``: the metric catalogues of the sidecar and the operator, as Markdown.

Why generated: the catalogues in code (:data:`kvstrata.sidecar.metrics.CATALOGUE`,
:data:`kvstrata.operator.metrics.CATALOGUE`) are what ``/metrics`` serves and
tests check against live endpoints; the page is rendered from them by
``make docs`` and a test fails when it is stale.
"""

from __future__ import annotations

from kvstrata.operator import metrics as operator_metrics
from kvstrata.sidecar import metrics as sidecar_metrics


def render() -> str:
    lines = [
        "# Metrics",
        "",
        "Every metric kvstrata serves. Generated from the catalogues in the code by",
        "`make docs`; a test checks this page against the code and the code against",
        "a live `/metrics`.",
        "",
        "A metric marked * has series only where it applies (the breaker's, for a",
        "shared tier; a managed Valkey's, for a KVCache that has one) or from its",
        "first event (label values not known before); every other series is served",
        "from the start, at 0.",
        "",
        "## Sidecar (`/metrics` on port 9464 of every injected pod)",
        "",
        *sidecar_metrics.catalogue_table(sidecar_metrics.CATALOGUE),
        "",
        "## Operator (`/metrics` on `--metrics-port`, 9465 by default)",
        "",
        *operator_metrics.catalogue_table(operator_metrics.CATALOGUE),
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render(), end="")
