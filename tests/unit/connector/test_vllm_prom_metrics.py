"""The connector's counters on vLLM's ``/metrics`` (``vllm:kvstrata_*``), read
from a registry of their own: served at 0 from the start, then counted."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest

prometheus_client = pytest.importorskip("prometheus_client")
pytest.importorskip("vllm")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram  # noqa: E402

from kvstrata.connector.stats import KVStrataPromMetrics  # noqa: E402


def metrics() -> tuple[KVStrataPromMetrics, CollectorRegistry]:
    registry = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    config = SimpleNamespace(kv_transfer_config=None)
    labels = {0: ["tiny", "0"]}
    return KVStrataPromMetrics(config, types, ["model_name", "engine"], labels), registry


def hits(registry: CollectorRegistry, tier: str) -> float | None:
    labels = {"model_name": "tiny", "engine": "0", "tier": tier}
    return registry.get_sample_value("vllm:kvstrata_hit_tokens_total", labels)


def test_hit_tokens_of_the_standing_tiers_are_served_at_zero_before_the_first_hit():
    _, registry = metrics()
    assert hits(registry, "l1") == 0
    assert hits(registry, "l2") == 0
    assert hits(registry, "valkey") is None  # a shared tier appears with its first hit


def test_hit_tokens_count_what_the_connector_loaded_per_tier():
    prom, registry = metrics()
    prom.observe({"hit_tokens": {"l1": 1664, "valkey": 256}, "lookups": 2})
    assert hits(registry, "l1") == 1664
    assert hits(registry, "valkey") == 256
