"""The autoscaling examples' queries, evaluated by a real Prometheus.

A real sidecar (L1 of a few chunks, L2 on disk) serves a small workload
through a real client while a real ``prometheus`` scrapes it every second
and evaluates ``examples/autoscaling/recording-rules.yaml``: stores that
overflow L1 (every eviction is young: the workload is far shorter than
``young_eviction_seconds``), lookups that hit in L1, in L2 and nowhere. The
targets carry the labels the examples select on (namespace ``default``,
kvcache ``shared``), so every query runs exactly as written. Then:

* each rule of ``prometheus-adapter-values.yaml``: its ``seriesQuery``
  through ``/api/v1/series``, its ``metricsQuery`` with the adapter's
  template filled as the adapter fills it for one pod;
* each trigger query of ``keda-scaledobject.yaml``;
* each recorded series of ``recording-rules.yaml``;

must return the expected series with values that agree with the sidecar's
own ``/metrics`` once the workload has stopped. Moments are ordered by what
Prometheus scraped, not by time windows.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvstrata.testing.poll import wait_until

EXAMPLES = Path(__file__).parents[4] / "examples" / "autoscaling"
NAMESPACE, POD, KVCACHE = "default", "llama-0", "shared"  # what the examples select
CHUNK_BYTES = 256 << 10
L1_CHUNKS = 16
BATCH = 2  # chunks a store sends: well within a session's share of L1
RATE_WINDOW_S = 120.0  # the examples' [2m]
YOUNG_L1 = 'kvstrata_young_evictions_total{tier="l1"}'

pytestmark = pytest.mark.slow


def _docs(name: str) -> dict[str, Any]:
    return dict(yaml.safe_load((EXAMPLES / name).read_text()))


def adapter_rules() -> list[dict[str, Any]]:
    return list(_docs("prometheus-adapter-values.yaml")["rules"]["custom"])


def keda_queries() -> dict[str, str]:
    triggers = _docs("keda-scaledobject.yaml")["spec"]["triggers"]
    assert all(t["type"] == "prometheus" for t in triggers)
    return {t["name"]: t["metadata"]["query"] for t in triggers}


def adapter_query(rule: dict[str, Any], series: str) -> str:
    """``metricsQuery`` as the adapter sends it when an HPA asks for one pod's value."""
    matchers = f'namespace="{NAMESPACE}",pod=~"{POD}"'
    return (
        rule["metricsQuery"]
        .replace("<<.Series>>", series)
        .replace("<<.LabelMatchers>>", matchers)
        .replace("<<.GroupBy>>", "pod")
    )


@pytest.fixture
def scraped(sidecar_factory: Any, kit: Any, tmp_path: Path, prometheus_factory: Any) -> Iterator:
    rules = tmp_path / "autoscaling-rules.yaml"
    rules.write_text(yaml.safe_dump({"groups": _docs("recording-rules.yaml")["spec"]["groups"]}))
    sidecar = sidecar_factory("scale", {"l1": {"size_bytes": L1_CHUNKS * CHUNK_BYTES}}).start()
    prom = prometheus_factory(
        {"kvstrata-sidecar": f"127.0.0.1:{sidecar.http_port}"},
        namespace=NAMESPACE,
        pod=POD,
        extra={"kvstrata-sidecar": {"kvcache": KVCACHE}},
        rule_files=(rules,),
    )
    yield sidecar, kit, prom


def written_behind(sidecar: Any) -> bool:
    samples = sidecar.samples()
    return (
        samples['kvstrata_write_queue_depth{tier="l2"}']
        == 0
        == samples["kvstrata_writeback_pinned_bytes"]
    )


def run_workload(sidecar: Any, kit: Any, prom: Any) -> None:
    """Overflow L1 four times, then look every chunk up again (L1 and L2 hits)
    and some that were never stored (misses in both); a scrape after each L1's
    worth of stores, so that the counters rise over several samples."""
    client = sidecar.client(call_timeout_s=5.0)
    stored = []
    for seed in range(4 * L1_CHUNKS // BATCH):
        keys = kit.make_keys(BATCH, seed=500 + seed)
        assert kit.store(client, keys, CHUNK_BYTES, owner="fill") == BATCH
        stored += keys
        # Wait for write-behind: a chunk L1 evicts is then in L2, to be hit there.
        wait_until(lambda: written_behind(sidecar), 10, "write-behind to L2")
        if len(stored) % L1_CHUNKS == 0:
            last_scrape(prom, time.time())
    tiers: list[str] = []
    for key in stored:
        reply = client.lookup([key], prefetch=False, owner="again")
        assert reply is not None, client.errors
        tiers += reply.tiers
    assert "l1" in tiers and "l2" in tiers, tiers
    for key in kit.make_keys(8, seed=999):
        reply = client.lookup([key], prefetch=False, owner="new")
        assert reply is not None and reply.hit_chunks == 0
    client.close()


def last_scrape(prom: Any, after: float) -> float:
    """The timestamp of a scrape of the sidecar after ``after`` (Prometheus's clock)."""

    def newer() -> float | None:
        result = prom.query('timestamp(up{job="kvstrata-sidecar"})')
        stamp = float(result[0]["value"][1]) if result else 0.0
        return stamp if stamp > after else None

    return float(wait_until(newer, 60, "a scrape after the workload", step=0.2))


def window_increase(prom: Any, selector: str, at: float) -> float:
    """Last minus first raw sample of a counter in the rate window ending ``at``."""
    samples = prom.samples(selector, int(RATE_WINDOW_S), at)
    return samples[-1][1] - samples[0][1]


def rate_bounds(prom: Any, selector: str, at: float) -> tuple[float, float]:
    """The least and most ``rate(selector[2m])`` may be at ``at``, a moment after the
    last scrape, from the raw samples: Prometheus extrapolates the increase past the
    last sample by at most 1.1 average scrape intervals (and not at all before a
    first sample of 0)."""
    samples = prom.samples(selector, int(RATE_WINDOW_S), at)
    assert samples[0][1] == 0, "the window holds the run from its start"
    increase = samples[-1][1] - samples[0][1]
    sampled = samples[-1][0] - samples[0][0]
    step = sampled / (len(samples) - 1)
    return increase / RATE_WINDOW_S, increase * (sampled + 1.1 * step) / sampled / RATE_WINDOW_S


def test_every_autoscaling_query_returns_the_sidecars_figures(scraped: Any) -> None:
    sidecar, kit, prom = scraped
    run_workload(sidecar, kit, prom)
    at = last_scrape(prom, time.time())
    own = sidecar.samples()  # quiet now: what Prometheus scraped last
    young = own['kvstrata_young_evictions_total{tier="l1"}']
    assert young == own['kvstrata_evictions_total{tier="l1"}'] >= 3 * L1_CHUNKS
    # The window holds the whole run from 0, and ends on a scrape: Prometheus's
    # rate is then exactly the increase over the window, not extrapolated.
    assert window_increase(prom, YOUNG_L1, at) == young
    young_rate = young / RATE_WINDOW_S

    # The adapter: each seriesQuery finds the pod's series; each metricsQuery one value.
    expected = {
        "kvstrata_young_evictions_total": young_rate,
        "kvstrata_queued_loads": own["kvstrata_queued_loads"],
        "kvstrata_l1_free_bytes": own["kvstrata_l1_free_bytes"],
    }
    rules = adapter_rules()
    assert sorted(r["name"]["matches"].strip("^$") for r in rules) == sorted(expected)
    for rule in rules:
        series = prom.series(rule["seriesQuery"])
        assert series, rule["seriesQuery"]
        assert {(s["namespace"], s["pod"]) for s in series} == {(NAMESPACE, POD)}
        (name,) = {s["__name__"] for s in series}
        (result,) = prom.query(adapter_query(rule, name), at=at)
        assert result["metric"] == {"pod": POD}
        assert float(result["value"][1]) == pytest.approx(expected[name]), name
    assert own["kvstrata_l1_free_bytes"] == (
        own['kvstrata_tier_capacity_bytes{tier="l1"}'] - own['kvstrata_tier_usage_bytes{tier="l1"}']
    )

    # KEDA: one value per trigger, over the KVCache's pods (one here).
    keda = {name: prom.query(query, at=at) for name, query in keda_queries().items()}
    assert float(keda["thrash"][0]["value"][1]) == pytest.approx(young_rate)
    assert float(keda["queued-loads"][0]["value"][1]) == own["kvstrata_queued_loads"]

    # The recording rules, as Prometheus evaluated them after the last scrape.
    def recorded(name: str) -> list[dict[str, Any]] | None:
        result = prom.query(f"{name} and timestamp({name}) > {at}")
        return result or None

    ratios = wait_until(lambda: recorded("kvstrata:tier_hit_ratio:rate2m"), 30,
                        "a hit-ratio evaluation after the run")  # fmt: skip
    by_tier = {r["metric"]["tier"]: float(r["value"][1]) for r in ratios}
    assert set(by_tier) == {"l1", "l2"}
    for r in ratios:
        assert r["metric"]["namespace"] == NAMESPACE and r["metric"]["kvcache"] == KVCACHE
    for tier, ratio in by_tier.items():
        hits = own[f'kvstrata_hit_tokens_total{{tier="{tier}"}}']
        asked = own[f'kvstrata_tier_lookup_tokens_total{{tier="{tier}"}}']
        assert 0 < hits < asked
        assert ratio == pytest.approx(hits / asked, rel=1e-6), tier
    (thrash,) = wait_until(lambda: recorded('kvstrata:young_evictions:rate2m{tier="l1"}'), 30,
                           "a thrash evaluation after the run")  # fmt: skip
    low, high = rate_bounds(prom, YOUNG_L1, float(thrash["value"][0]))
    assert low <= float(thrash["value"][1]) <= high
    (free,) = wait_until(lambda: recorded("kvstrata:l1_free_ratio"), 30,
                         "a free-ratio evaluation after the run")  # fmt: skip
    capacity = own['kvstrata_tier_capacity_bytes{tier="l1"}']
    assert float(free["value"][1]) == pytest.approx(own["kvstrata_l1_free_bytes"] / capacity)
