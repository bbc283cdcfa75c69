"""The chart's PrometheusRule, each alert's expression evaluated by a real Prometheus.

The rules are rendered by Helm's own engine from the chart with short windows
(seconds instead of minutes: only the durations differ from a default
install), checked by ``promtool``, and evaluated through Prometheus's HTTP API
against a real sidecar (L1 of a few chunks, a real Valkey as its shared tier)
that Prometheus scrapes every second. First a healthy, warm workload: every
alert's condition is evaluated, on data, and false. Then one fault per alert,
each induced for real: lookups that start missing (the hit rate falls), the
Valkey server stopped (a degraded tier), L1 held by leases so that stores are
refused, and the sidecar restarted (a restart loop); each alert must fire.
Moments are ordered by what Prometheus scraped, not by time windows.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvstrata.testing.poll import wait_until

CHART = Path(__file__).parents[4] / "charts" / "kvstrata"
NAMESPACE, POD, KVCACHE = "team-a", "vllm-0", "quickstart"
CHUNK_BYTES = 256 << 10
L1_CHUNKS = 8
WINDOW_S, OFFSET_S = 5, 12
RULE_VALUES = {
    "monitoring": {
        "prometheusRule": {
            "enabled": True,
            "for": "0s",
            "window": f"{WINDOW_S}s",
            "restarts": 2,
            "restartWindow": "60s",
            "hitRateDrop": 0.5,
            "hitRateBaselineOffset": f"{OFFSET_S}s",
        }
    }
}

pytestmark = pytest.mark.slow


def rendered_rule_groups(values: dict[str, Any]) -> list[dict[str, Any]]:
    helm = pytest.importorskip("helm_python")
    manifests = helm.Chart.load(CHART).render(values=values, name="kvs", namespace="kvs-system")
    (text,) = [t for name, t in manifests.items() if name.endswith("prometheusrule.yaml")]
    rule = yaml.safe_load(text)
    assert rule["kind"] == "PrometheusRule"
    return rule["spec"]["groups"]


def alerts() -> dict[str, str]:
    return {r["alert"]: r["expr"] for g in rendered_rule_groups(RULE_VALUES) for r in g["rules"]}


def as_bool(expr: str) -> str:
    """The expression with each comparison made a ``bool`` one: 0 or 1 per series
    instead of filtering, so a quiet condition is seen evaluated on data."""
    return re.sub(r"\s(>=|<=|==|>|<)\s", r" \1 bool ", expr)


def test_the_rendered_rules_pass_promtool(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("no promtool: run `make system-deps` (Debian package prometheus)")
    for values in (RULE_VALUES, {"monitoring": {"prometheusRule": {"enabled": True}}}):
        rules = tmp_path / "rules.yaml"
        rules.write_text(yaml.safe_dump({"groups": rendered_rule_groups(values)}))
        done = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True,
                              text=True, timeout=60)  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
    assert set(alerts()) == {
        "KVStrataTierDegraded",
        "KVStrataStoresRefused",
        "KVStrataSidecarRestartLoop",
        "KVStrataHitRateFalling",
    }


@pytest.fixture
def watched(
    sidecar_factory: Any, kit: Any, tmp_path: Path, prometheus_factory: Any
) -> Iterator[tuple[Any, Any, Any]]:
    from kvstrata.testing.servers import RedisServer

    with RedisServer(tmp_path / "valkey") as valkey:
        shared = {
            "backend": "valkey",
            "valkey": {"url": valkey.url, "key_prefix": f"alerts-{uuid.uuid4().hex[:8]}:"},
            "breaker_failures": 1,
            "breaker_reset_seconds": 30.0,  # stays open through the check
            "lookup_timeout_seconds": 0.2,
        }
        l1 = {"size_bytes": L1_CHUNKS * CHUNK_BYTES}
        sidecar = sidecar_factory("alerts", {"shared": shared, "l1": l1}).start()
        jobs = {"kvstrata-sidecar": f"127.0.0.1:{sidecar.http_port}"}
        extra = {"kvstrata-sidecar": {"kvcache": KVCACHE}}
        prom = prometheus_factory(jobs, namespace=NAMESPACE, pod=POD, extra=extra)
        yield sidecar, valkey, prom


def scraped_after(prom: Any, moment: float) -> float:
    """A moment at which Prometheus holds a scrape of the sidecar taken after ``moment``."""

    def later() -> float | None:
        series = prom.query("timestamp(kvstrata_lookups_total)")
        return float(series[0]["value"][0]) if series and float(
            series[0]["value"][1]) > moment else None  # fmt: skip

    return wait_until(later, 30, "a scrape after the moment")


def test_each_alert_is_silent_on_a_healthy_sidecar_and_fires_on_its_fault(
    watched: tuple[Any, Any, Any], kit: Any
) -> None:
    sidecar, valkey, prom = watched
    rules = alerts()
    client = sidecar.client(call_timeout_s=5.0)
    warm = kit.make_keys(2, seed=7001)  # a session may hold a quarter of L1 uncommitted
    assert kit.store(client, warm, CHUNK_BYTES, owner="w") == 2

    def for_seconds(seconds: float, step: Any) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            step()
            time.sleep(0.1)

    def hits() -> None:
        reply = client.lookup(warm, prefetch=False, owner="w")
        assert reply is not None and reply.hit_chunks == 2, client.errors

    # Healthy and warm for longer than the window plus the hit rate's baseline offset.
    for_seconds(WINDOW_S + OFFSET_S + 3, hits)
    quiet = scraped_after(prom, time.time())
    for name, expr in rules.items():
        assert prom.query(expr, at=quiet) == [], f"{name} fires on a healthy sidecar"
        if name != "KVStrataSidecarRestartLoop":  # its second source needs kube-state-metrics
            evaluated = prom.query(as_bool(expr), at=quiet)
            assert evaluated, f"{name}: nothing to evaluate on"
            assert {float(s["value"][1]) for s in evaluated} == {0.0}, (name, evaluated)

    # The hit rate falls: every lookup misses from now on.
    seed = iter(range(8000, 9000))

    def misses() -> None:
        reply = client.lookup(kit.make_keys(4, seed=next(seed)), prefetch=False, owner="c")
        assert reply is not None and reply.hit_chunks == 0, client.errors

    for_seconds(WINDOW_S + 1, misses)
    fallen = scraped_after(prom, time.time())
    firing = prom.query(rules["KVStrataHitRateFalling"], at=fallen)
    assert [s["metric"].get("kvcache") for s in firing] == [KVCACHE], firing

    # A degraded tier: the Valkey server stopped under traffic.
    valkey.stop()
    wait_until(
        lambda: misses() is None and prom.query(rules["KVStrataTierDegraded"]),
        60,
        "KVStrataTierDegraded to fire with Valkey stopped",
    )
    (degraded,) = prom.query(rules["KVStrataTierDegraded"])
    assert degraded["metric"]["tier"] == "valkey"

    # Refused stores: writers that reserve L1 and do not commit yet hold all of
    # it (each session its quarter), so a store finds nothing to evict.
    writers = [sidecar.client(call_timeout_s=5.0) for _ in range(4)]
    reserved = [
        w.prepare_store(kit.make_keys(2, seed=7100 + i), CHUNK_BYTES, "uint8", (CHUNK_BYTES,), "h")
        for i, w in enumerate(writers)
    ]
    late = client.prepare_store(kit.make_keys(1, seed=7200), CHUNK_BYTES, "uint8",
                                (CHUNK_BYTES,), "r")  # fmt: skip
    assert None in [slot for slots in [*reserved, late] for slot in slots or [None]]
    wait_until(
        lambda: prom.query(rules["KVStrataStoresRefused"]),
        30,
        "KVStrataStoresRefused to fire",
    )
    for w in [*writers, client]:
        w.close()

    # A restart loop: the sidecar restarted twice within the window.
    assert prom.query(rules["KVStrataSidecarRestartLoop"]) == []
    for _ in range(2):
        sidecar.restart()
        scraped_after(prom, time.time())
    firing = wait_until(
        lambda: prom.query(rules["KVStrataSidecarRestartLoop"]),
        30,
        "KVStrataSidecarRestartLoop to fire",
    )
    assert firing[0]["metric"]["pod"] == POD
