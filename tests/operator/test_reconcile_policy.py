"""The parts of a reconcile pass on their own: conditions, the shared-tier Event, the retry."""

from __future__ import annotations

from kvstrata.operator import reconcile as rec
from kvstrata.operator.sharedtier import Probe

NOW = "2026-01-01T00:00:00Z"
LATER = "2026-01-01T00:05:00Z"
READY = Probe(True, "ValkeyReady", "1/1 Valkey pods ready")
STARTING = Probe(False, "ValkeyStarting", "0/1 Valkey pods ready")
UNREACHABLE = Probe(False, "ValkeyUnreachable", "PING failed")


def conditions(report: rec.StatusReport) -> dict[str, dict]:
    return {c["type"]: c for c in report.status["conditions"]}


def test_retry_soon_while_valkey_starts_later_when_unreachable_never_when_ready():
    assert rec.retry_delay(READY) is None
    assert rec.retry_delay(STARTING) == rec.CONVERGE_DELAY_S
    assert rec.retry_delay(UNREACHABLE) == rec.UNREACHABLE_DELAY_S


def test_the_shared_tier_event_is_posted_once_per_new_reason():
    assert rec.shared_tier_event(None, READY) is None
    assert rec.shared_tier_event(None, STARTING) == rec.Event(
        "Normal", "ValkeyStarting", STARTING.message
    )
    assert rec.shared_tier_event("ValkeyStarting", STARTING) is None
    assert rec.shared_tier_event("ValkeyStarting", UNREACHABLE).type == "Warning"


def test_a_starting_valkey_is_not_ready_and_not_degraded():
    report = rec.StatusReport.start({"metadata": {"generation": 2}}, NOW)
    report.shared_tier(STARTING, "abc", "valkey-managed")
    got = conditions(report)
    assert [got[t]["status"] for t in ("SharedTierReady", "Ready", "Degraded")] == [
        "False",
        "False",
        "False",
    ]
    assert got["Ready"]["observedGeneration"] == 2
    assert report.reason("SharedTierReady") == "ValkeyStarting"


def test_transition_times_change_only_when_a_condition_flips():
    first = rec.StatusReport.start({}, NOW)
    first.shared_tier(READY, "abc", "valkey-managed")
    again = rec.StatusReport.start({"status": first.status}, LATER)
    again.shared_tier(READY, "abc", "valkey-managed")
    assert conditions(again)["Ready"]["lastTransitionTime"] == NOW
    again.invalid_spec("spec.l1.policy: bad")
    assert conditions(again)["Ready"]["lastTransitionTime"] == LATER
    assert conditions(again)["Degraded"]["reason"] == "InvalidSpec"
