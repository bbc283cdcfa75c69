"""The engine's typed counters as the STATS reply and /status show them."""

from __future__ import annotations

from kvstrata.sidecar.counters import EngineCounters, EngineGauges, as_status


def test_the_status_counters_keep_their_names_per_tier_and_per_gauge():
    counters = EngineCounters(promotions_total={"l2": 2}, hit_chunks_total={"l1": 5})
    counters.promotion_failures_total = 1
    status = as_status(counters, EngineGauges(leases_active=3))
    assert status["promotions_total_l2"] == 2
    assert status["hit_chunks_total_l1"] == 5
    assert status["promotion_failed_total"] == 1
    assert status["leases_active"] == 3
    assert status["queued_loads"] == 0
