"""The circuit breaker's states, driven by a hand-set clock."""

from __future__ import annotations

import pytest

from kvstrata.sidecar.tiers.breaker import CircuitBreaker


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def opened(clock: Clock, failures: int = 3, reset: float = 1.0) -> CircuitBreaker:
    breaker = CircuitBreaker(failures, reset, clock=clock)
    for _ in range(failures):
        assert breaker.allow()
        breaker.record_failure()
    return breaker


def test_breaker_opens_after_the_configured_consecutive_failures() -> None:
    clock = Clock()
    breaker = CircuitBreaker(3, 1.0, clock=clock)
    for _ in range(2):
        breaker.record_failure()
    assert breaker.state == "closed" and breaker.allow()
    breaker.record_failure()
    assert breaker.state == "open" and not breaker.allow() and breaker.is_open


def test_a_success_resets_the_failure_count() -> None:
    breaker = CircuitBreaker(3, 1.0, clock=Clock())
    breaker.record_failure()
    breaker.record_failure()
    breaker.record_success()
    breaker.record_failure()
    breaker.record_failure()
    assert breaker.state == "closed"


def test_after_the_reset_time_exactly_one_probe_is_let_through() -> None:
    clock = Clock()
    breaker = opened(clock)
    clock.now += 1.0
    assert breaker.state == "half_open"
    assert breaker.allow()
    assert not breaker.allow()  # a second caller waits for the probe's outcome
    breaker.record_success()
    assert breaker.state == "closed" and breaker.allow()


def test_a_failed_probe_reopens_for_twice_as_long() -> None:
    clock = Clock()
    breaker = opened(clock)
    clock.now += 1.0
    assert breaker.allow()
    breaker.record_failure()
    assert breaker.state == "open"
    clock.now += 1.5
    assert not breaker.allow()
    clock.now += 0.5
    assert breaker.allow()


def test_a_probe_that_never_reports_does_not_wedge_the_breaker() -> None:
    clock = Clock()
    breaker = opened(clock)
    clock.now += 1.0
    assert breaker.allow()
    clock.now += 1.0
    assert breaker.allow()


def test_nonsense_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="failures"):
        CircuitBreaker(0, 1.0)
    with pytest.raises(ValueError, match="reset_seconds"):
        CircuitBreaker(1, 0)
