"""A live sidecar's /metrics serves exactly the catalogue (docs/metrics.md): every
metric listed is there with its type and labels, and nothing unlisted is."""

from __future__ import annotations

from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kvstrata.sidecar.metrics import CATALOGUE

NBYTES = 4096


def exposed_name(family: Any) -> str:
    """The parser drops a counter's _total; the catalogue names what is served."""
    return f"{family.name}_total" if family.type == "counter" else family.name


def test_metrics_endpoint_serves_exactly_the_catalogue(sidecar: Any, kit: Any):
    client = sidecar.client()
    keys = kit.make_keys(6, seed=77)
    kit.store(client, keys, NBYTES, owner="w")
    assert client.lookup(keys, prefetch=True, owner="r").hit_chunks == 6
    kit.retrieve(client, keys, owner="r")
    families = {exposed_name(f): f for f in text_string_to_metric_families(sidecar.get("/metrics"))}
    catalogue = {m.name: m for m in CATALOGUE}

    assert set(families) - set(catalogue) == set(), "served but not in the catalogue"
    assert set(catalogue) - set(families) == set(), "in the catalogue but not served"
    for name, spec in catalogue.items():
        family = families[name]
        assert family.type == spec.type, name
        assert family.documentation == spec.help, name
        for sample in family.samples:
            labels = set(sample.labels) - ({"le"} if spec.type == "histogram" else set())
            assert labels == set(spec.labels), (name, sample)
    # Labelled metrics the workload touched carry samples, not just a declaration.
    for name in ("kvstrata_hit_tokens_total", "kvstrata_stored_bytes_total"):
        assert families[name].samples, name
    client.close()
