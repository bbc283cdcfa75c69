"""A tier's stats: a core every tier keeps, and parts only some tiers have.

Why: ``TierStats`` carried the breaker's, S3's and Valkey's fields for
every tier, so a disk tier's stats (and its /status) spoke of S3 refreshes.
Now those are :class:`BreakerStats`, :class:`S3Stats` and
:class:`ValkeyStats`, present where the tier has them; the series on
/metrics read them through the flat names with the values they always had
(0, none, or no series for a tier without the part).
"""

from __future__ import annotations

from dataclasses import fields

from kvstrata.sidecar.engine import EngineStats
from kvstrata.sidecar.engine_metrics import _tier_metrics
from kvstrata.sidecar.tiers.base import TierStats
from kvstrata.sidecar.tiers.stats import BreakerStats, S3Stats, ValkeyStats

# The fields only some backends have, which the core must not name.
BACKEND_ONLY = frozenset(
    {
        "breaker_state",
        "breaker_opened_total",
        "refreshed_total",
        "refresh_dropped_total",
        "lookup_gets_used_total",
        "lookup_gets_closed_total",
        "expired_total",
        "server_evicted_keys",
    }
)


def test_the_core_names_no_field_of_one_backend() -> None:
    names = {f.name for f in fields(TierStats)}
    assert names & BACKEND_ONLY == set()
    assert {"breaker", "backend"} <= names


def _every_kind() -> EngineStats:
    return EngineStats(
        tiers={
            "l1": TierStats(tier="l1", usage_bytes=5),
            "l2": TierStats(tier="l2", objects=3),
            "valkey": TierStats(
                tier="valkey", breaker=BreakerStats("closed", 1), backend=ValkeyStats(7)
            ),
            "s3": TierStats(
                tier="s3",
                breaker=BreakerStats("open", 2),
                degraded=True,
                backend=S3Stats(
                    refreshed_total=3,
                    refresh_dropped_total=4,
                    lookup_gets_used_total=5,
                    lookup_gets_closed_total=6,
                    expired_total=8,
                ),
            ),
        },
    )


def _series(name: str) -> dict[tuple[str, ...], float]:
    """The samples named ``name`` (a counter's family drops the ``_total``), by labels."""
    return {
        tuple(s.labels.values()): s.value
        for family in _tier_metrics(_every_kind())
        for s in family.samples
        if s.name == name
    }


def test_the_s3_series_read_its_part_and_zero_for_every_other_tier() -> None:
    for name, value in [
        ("kvstrata_tier_refreshed_total", 3),
        ("kvstrata_tier_refresh_dropped_total", 4),
        ("kvstrata_tier_lookup_gets_used_total", 5),
        ("kvstrata_tier_lookup_gets_closed_total", 6),
        ("kvstrata_tier_expired_total", 8),
    ]:
        assert _series(name) == {("l1",): 0, ("l2",): 0, ("valkey",): 0, ("s3",): value}, name


def test_the_valkey_evictions_are_a_series_of_the_valkey_tier_only() -> None:
    assert _series("kvstrata_tier_server_evicted_keys") == {("valkey",): 7}


def test_the_breaker_series_are_those_of_the_tiers_with_a_breaker() -> None:
    assert _series("kvstrata_tier_breaker_state") == {
        ("valkey", "closed"): 1,
        ("valkey", "open"): 0,
        ("valkey", "half_open"): 0,
        ("s3", "closed"): 0,
        ("s3", "open"): 1,
        ("s3", "half_open"): 0,
    }
    assert _series("kvstrata_tier_breaker_opened_total") == {("valkey",): 1, ("s3",): 2}


def test_a_tier_without_a_part_reads_as_it_always_did() -> None:
    disk = TierStats(tier="l2")
    assert (disk.breaker_state, disk.breaker_opened_total) == ("", 0)
    assert (disk.refreshed_total, disk.expired_total, disk.server_evicted_keys) == (0, 0, None)
    # An S3 tier has no Valkey figure, and the other way round.
    assert TierStats(tier="s3", backend=S3Stats()).server_evicted_keys is None
    assert TierStats(tier="valkey", backend=ValkeyStats(7)).refreshed_total == 0


def test_a_snapshot_does_not_change_with_later_counting() -> None:
    live = TierStats(tier="s3", breaker=BreakerStats(), backend=S3Stats())
    snap = live.snapshot()
    live.count_error("timeout")
    live.count_decrypt_failure("bad_tag")
    assert live.breaker is not None and isinstance(live.backend, S3Stats)
    live.breaker.opened_total += 1
    live.backend.expired_total += 1
    assert snap.errors_total == {} and snap.decrypt_failures_total == {}
    assert (snap.breaker_opened_total, snap.expired_total) == (0, 0)
