"""Every query of the shipped Grafana dashboard, evaluated by a real Prometheus.

A real sidecar (L1 small enough to evict, L2 on disk, a real Valkey as the
shared tier) serves a workload through a real client while Prometheus scrapes
it every second: cold stores and lookups, repeated lookups of the same
chunks, evictions from L1, promotions back from L2, and an outage of the
Valkey server (killed, then restarted on the same port), which evicts under
its ``maxmemory``. Then each panel's
expressions, with the dashboard's template variables substituted as Grafana
would, go through Prometheus's HTTP API. A query that returns nothing fails;
values must be plausible for the panel (ratios in [0, 1], rates > 0 while
traffic flowed, usage <= capacity, the shared-tier health panel showing the
outage and the recovery).
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstrata.testing.poll import wait_until

DASHBOARD = Path(__file__).parents[4] / "charts" / "kvstrata" / "dashboards" / "kvstrata.json"
NAMESPACE, POD, KVCACHE = "team-a", "vllm-0", "quickstart"
SCRAPE_S = 1.0
RATE_INTERVAL = "4s"  # Grafana's $__rate_interval for a 1 s scrape: 4 x scrape interval
CHUNK_BYTES = 256 << 10
L1_CHUNKS = 32  # L1 of 8 MiB holds 32 chunks: the workload stores more, so L1 evicts

pytestmark = pytest.mark.slow


def dashboard_panels() -> list[dict[str, Any]]:
    """Every panel with queries, rows' nested panels included."""
    panels = []
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        panels += panel.get("panels", [])
        if panel.get("targets"):
            panels.append(panel)
    return panels


def substitute(expr: str) -> str:
    """The expression as Grafana sends it with this namespace and pod selected."""
    return (
        expr.replace("$__rate_interval", RATE_INTERVAL)
        .replace("$namespace", NAMESPACE)
        .replace("$kvcache", KVCACHE)
        .replace("$pod", POD)
    )


def values(series: list[dict[str, Any]]) -> list[float]:
    return [float(v) for s in series for _, v in s["values"] if v not in ("NaN", "+Inf", "-Inf")]


def per_series(series: list[dict[str, Any]], label: str) -> dict[str, list[tuple[float, float]]]:
    return {
        s["metric"].get(label, ""): [(float(t), float(v)) for t, v in s["values"]] for s in series
    }


class Workload:
    """Traffic through a real client, with the wall-clock marks of each phase."""

    def __init__(self, sidecar: Any, kit: Any, valkey: Any) -> None:
        self.sidecar, self.kit, self.valkey = sidecar, kit, valkey
        self.client = sidecar.client(call_timeout_s=5.0)
        self.marks: dict[str, float] = {}
        self._seed = 0

    def _keys(self, n: int) -> list[Any]:
        self._seed += 1
        return self.kit.make_keys(n, seed=1000 + self._seed)

    def for_seconds(self, seconds: float, step: Callable[[], None]) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            step()
            time.sleep(0.1)

    def cold(self, seconds: float) -> list[Any]:
        """New chunks only: every lookup misses, then they are stored."""
        stored: list[Any] = []

        def step() -> None:
            keys = self._keys(4)
            reply = self.client.lookup(keys, prefetch=False, owner="cold")
            assert reply is not None and reply.hit_chunks == 0, self.client.errors
            self.kit.store(self.client, keys, CHUNK_BYTES, owner="cold")
            stored.extend(keys)

        self.for_seconds(seconds, step)
        return stored

    def warm(self, seconds: float, keys: list[Any]) -> None:
        """The same chunks again and again: lookups hit, retrieves read them."""

        def step() -> None:
            reply = self.client.lookup(keys, prefetch=False, owner="warm")
            assert reply is not None and reply.hit_chunks == len(keys), self.client.errors
            self.kit.retrieve(self.client, keys, owner="warm")

        self.for_seconds(seconds, step)

    def promote(self, evicted: list[Any]) -> None:
        """Read back chunks L1 evicted: the engine promotes them from L2 (or Valkey)."""
        for i in range(0, len(evicted), 4):
            keys = evicted[i : i + 4]
            self.client.lookup(keys, prefetch=False, owner="promote")
            got = self.kit.retrieve(self.client, keys, owner="promote")
            assert got == [self.kit.payload(k, CHUNK_BYTES) for k in keys]


@pytest.fixture
def observed(sidecar_factory: Any, kit: Any, tmp_path: Path, prometheus_factory: Any) -> Iterator:
    from kvstrata.testing.servers import RedisServer

    # A small maxmemory under allkeys-lru: the server evicts, as a cache server does.
    lru = ("--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru")
    with RedisServer(tmp_path / "valkey", extra_args=lru) as valkey:
        shared = {
            "backend": "valkey",
            "valkey": {"url": valkey.url, "key_prefix": f"obs-{uuid.uuid4().hex[:8]}:"},
            "breaker_failures": 1,
            "breaker_reset_seconds": 0.5,
            "lookup_timeout_seconds": 0.2,
        }
        sidecar = sidecar_factory(
            "obs", {"shared": shared, "l1": {"size_bytes": L1_CHUNKS * CHUNK_BYTES}}
        ).start()
        with operator_activity() as operator_port:
            jobs = {
                "kvstrata-sidecar": f"127.0.0.1:{sidecar.http_port}",
                "kvstrata-operator": f"127.0.0.1:{operator_port}",
            }
            # The chart's ServiceMonitor gives the sidecars' series the kvcache label.
            extra = {"kvstrata-sidecar": {"kvcache": KVCACHE}}
            prom = prometheus_factory(jobs, namespace=NAMESPACE, pod=POD, extra=extra)
            yield Workload(sidecar, kit, valkey), prom


@contextlib.contextmanager
def operator_activity() -> Iterator[int]:
    """The operator's /metrics on a real port, recording what its handlers record
    (reconciles of each outcome, admissions, a managed Valkey that becomes ready)
    every 0.2 s while the test runs; the handlers' own counting is tested in
    tests/operator/test_operator_metrics.py."""
    from kvstrata.operator.metrics import OperatorMetrics, serve
    from kvstrata.operator.s3bounds import Sweep
    from kvstrata.testing.servers import free_port

    metrics, port = OperatorMetrics(), free_port()
    stop_serving = serve(metrics, "127.0.0.1", port)
    done = threading.Event()

    def record() -> None:
        ticks = 0
        while not done.wait(0.2):
            ticks += 1
            metrics.record_reconcile("ready" if ticks % 3 else "progressing", 0.01 * (ticks % 5))
            metrics.record_admission("injected" if ticks % 4 else "skipped", "kvcache_not_found",
                                     0.002)  # fmt: skip
            metrics.set_valkey_ready(NAMESPACE, KVCACHE, ticks > 10)
            swept = ticks % 2
            metrics.record_sweep(NAMESPACE, KVCACHE, Sweep(10 + ticks, 4096, swept, 128 * swept))

    thread = threading.Thread(target=record, daemon=True)
    thread.start()
    try:
        yield port
    finally:
        done.set()
        thread.join(5)
        stop_serving()


def check_ratio(panel: str, series: list[dict[str, Any]]) -> None:
    assert all(0.0 <= v <= 1.0 for v in values(series)), f"{panel}: a ratio outside [0, 1]"


def check_non_negative(panel: str, series: list[dict[str, Any]]) -> None:
    assert all(v >= 0.0 for v in values(series)), f"{panel}: a negative rate or size"


def check_flowed(panel: str, series: list[dict[str, Any]], tiers: tuple[str, ...]) -> None:
    """Each of ``tiers`` moved bytes at some point of the workload."""
    peaks = {tier: max(v for _, v in points) for tier, points in per_series(series, "tier").items()}
    for tier in tiers:
        assert peaks.get(tier, 0.0) > 0.0, f"{panel}: no {tier} traffic seen ({peaks})"


def scraped_after(prom: Any, moment: float) -> float:
    """Wait until Prometheus holds a scrape of the sidecar taken after
    ``moment`` (a wall-clock reading, Prometheus's own time base); that
    scrape's timestamp. A phase's end is then a scrape that saw all of it,
    whatever the machine's load did to the scrape schedule."""
    expr = 'timestamp(up{job="kvstrata-sidecar"})'

    def newer() -> float | None:
        result = prom.query(expr)
        stamp = float(result[0]["value"][1]) if result else 0.0
        return stamp if stamp > moment else None

    return wait_until(newer, 60, "a scrape of the sidecar after the phase", step=0.2)


def test_every_dashboard_query_returns_plausible_data(observed: Any) -> None:
    work, prom = observed
    panels = dashboard_panels()
    health = substitute(panel_expr(panels, "Shared tier health"))

    def valkey_health() -> float | None:
        """The health panel's value for Valkey at the latest scrape."""
        for series in prom.query(health):
            if series["metric"].get("tier") == "valkey":
                return float(series["value"][1])
        return None

    start = time.time()
    stored = work.cold(6.0)
    assert len(stored) > 2 * L1_CHUNKS, "the cold phase must overflow L1"
    cold_end = scraped_after(prom, time.time())
    work.warm(6.0, stored[-8:])
    warm_end = scraped_after(prom, time.time())
    work.promote(stored[:16])

    # The outage: cold traffic against a stopped Valkey until a scrape shows
    # the health panel at 1, then again after Valkey's return until it
    # shows 0. Ordered by what Prometheus scraped, not by a time window.
    work.valkey.stop()
    wait_until(
        lambda: work.cold(0.5) is not None and valkey_health() == 1.0,
        60,
        "the health panel to show the Valkey outage",
    )
    work.valkey.start()
    wait_until(
        lambda: work.cold(0.5) is not None and valkey_health() == 0.0,
        60,
        "the health panel to show Valkey back",
    )
    work.cold(6.0)
    end = scraped_after(prom, time.time())

    checks: dict[str, Callable[[str, list[dict[str, Any]]], None]] = {
        "Hit rate (all tiers)": check_ratio,
        "Hit rate per tier": check_ratio,
        "L1 / L2 usage": check_ratio,
        "Managed Valkey ready": check_ratio,
        "Bytes stored per tier": lambda p, s: check_flowed(p, s, ("l1", "l2", "valkey")),
        "Bytes retrieved per tier": lambda p, s: check_flowed(p, s, ("l1", "l2")),
    }
    assert {p["title"] for p in panels} >= set(checks), "a checked panel left the dashboard"
    for panel in panels:
        for target in panel["targets"]:
            expr = substitute(target["expr"])
            series = prom.query_range(expr, start, end)
            assert values(series), f"{panel['title']}: {expr} returned no data"
            check_non_negative(panel["title"], series)
            if panel["title"] in checks:
                checks[panel["title"]](panel["title"], series)

    hit_rate = substitute(panel_expr(panels, "Hit rate (all tiers)"))
    cold_rate = float(prom.query(hit_rate, at=cold_end)[0]["value"][1])
    warm_rate = float(prom.query(hit_rate, at=warm_end)[0]["value"][1])
    assert cold_rate < 0.05 < 0.9 < warm_rate, (cold_rate, warm_rate)
    # The KVCache filter selects: another KVCache's name leaves the panel empty.
    other = hit_rate.replace(f'kvcache=~"{KVCACHE}"', 'kvcache=~"another"')
    assert other != hit_rate and prom.query(other, at=warm_end) == []

    used, capacity = (substitute(t["expr"]) for t in panel_targets(panels, "Tier bytes used"))
    held = {s["metric"]["tier"]: float(s["value"][1]) for s in prom.query(used, at=end)}
    room = {s["metric"]["tier"]: float(s["value"][1]) for s in prom.query(capacity, at=end)}
    for tier in ("l1", "l2"):
        assert 0 < held[tier] <= room[tier], (tier, held, room)

    # The server evicted (maxmemory, allkeys-lru) and the panel shows it.
    evicted, _ = panel_targets(panels, "Shared tier evictions and refreshes/s")
    evictions = substitute(evicted["expr"])
    peaks = per_series(prom.query_range(evictions, start, end), "tier")
    assert max(v for _, v in peaks["valkey"]) > 0, f"no server evictions seen: {peaks}"

    # The breaker behind the panel: it opened during the outage and is closed again.
    selector = f'tier="valkey", namespace="{NAMESPACE}", pod="{POD}"'
    opened = prom.query(f"kvstrata_tier_breaker_opened_total{{{selector}}}", at=end)
    assert float(opened[0]["value"][1]) >= 1, opened
    state = prom.query(f"kvstrata_tier_breaker_state{{{selector}}} == 1", at=end)
    assert [s["metric"]["state"] for s in state] == ["closed"], state


def panel_targets(panels: list[dict[str, Any]], title: str) -> list[dict[str, Any]]:
    for panel in panels:
        if panel["title"] == title:
            return panel["targets"]
    raise AssertionError(f"no panel {title!r} in {DASHBOARD}")


def panel_expr(panels: list[dict[str, Any]], title: str) -> str:
    (target,) = panel_targets(panels, title)
    return target["expr"]
