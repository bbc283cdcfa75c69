"""The encryption key ring's metrics, read at scrape time.

Why its own module: the key ring lives apart from the engine (the tiers
share it); the catalogue rows stay in :mod:`.metrics` with every other
metric's. With encryption off the series read 0.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvstrata.sidecar.metrics import SPECS
from kvstrata.sidecar.sealing import KeyRing


def _family(name: str, value: float) -> Metric:
    spec = SPECS[name]
    kind = CounterMetricFamily if spec.type == "counter" else GaugeMetricFamily
    family = kind(name, spec.help, labels=list(spec.labels))
    family.add_metric([], value)
    return family


class KeyRingCollector(Collector):
    """Keys loaded, reloads and reloads refused, of one :class:`KeyRing`."""

    def __init__(self, keys: KeyRing | None) -> None:
        self._keys = keys

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        keys = self._keys
        yield _family("kvstrata_encryption_keys", len(keys.key_ids) if keys else 0)
        yield _family("kvstrata_encryption_key_reloads_total", keys.reloads_total if keys else 0)
        yield _family(
            "kvstrata_encryption_key_reload_failures_total",
            keys.reload_failures_total if keys else 0,
        )
