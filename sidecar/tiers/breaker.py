"""A circuit breaker for the shared (remote) tiers.

A remote tier that is down must cost the engine nothing: without a breaker
every lookup would wait out a socket timeout. After ``failures`` consecutive
failed calls the breaker *opens* and :meth:`CircuitBreaker.allow` says no
for ``reset_seconds`` (callers answer miss / False at once). Then it is
*half-open*: exactly one caller is let through as a probe; its success
closes the breaker, its failure opens it for another ``reset_seconds``.

Each open period doubles the wait, up to ``max_reset_seconds``, so a server
that stays down for minutes is probed ever less often (reconnect with
backoff); a success resets the wait to ``reset_seconds``.

State kept (in memory only)::

    state                  "closed" | "open" | "half_open"
    consecutive_failures   failures since the last success
    opened_at              monotonic time the breaker last opened
    current_reset          seconds the present open period lasts
    opened_total           how many times it opened
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Literal

BreakerState = Literal["closed", "open", "half_open"]


class CircuitBreaker:
    """Thread-safe closed / open / half-open breaker (see module docstring)."""

    def __init__(
        self,
        failures: int,
        reset_seconds: float,
        max_reset_seconds: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if failures < 1:
            raise ValueError(f"failures must be >= 1, got {failures}")
        if reset_seconds <= 0:
            raise ValueError(f"reset_seconds must be > 0, got {reset_seconds}")
        self.failures = failures
        self.reset_seconds = reset_seconds
        self.max_reset_seconds = max(max_reset_seconds or 8 * reset_seconds, reset_seconds)
        self._clock = clock
        self._lock = threading.Lock()
        self._state: BreakerState = "closed"
        self._consecutive = 0
        self._opened_at = 0.0
        self._current_reset = reset_seconds
        self._probe_in_flight = False
        self._probe_started = 0.0
        self.opened_total = 0

    @property
    def state(self) -> BreakerState:
        with self._lock:
            self._maybe_half_open()
            return self._state

    @property
    def is_open(self) -> bool:
        """True while calls are being skipped (open, or half-open with a probe out)."""
        with self._lock:
            self._maybe_half_open()
            return self._state == "open" or (self._state == "half_open" and self._probe_in_flight)

    def allow(self) -> bool:
        """Whether a call may go to the remote now; a True in half-open is the probe.

        A caller that got True must report the outcome with
        :meth:`record_success` or :meth:`record_failure`.
        """
        with self._lock:
            self._maybe_half_open()
            if self._state == "closed":
                return True
            if self._state == "half_open" and (
                not self._probe_in_flight
                # A probe whose caller never reported must not wedge the breaker.
                or self._clock() - self._probe_started >= self._current_reset
            ):
                self._probe_in_flight = True
                self._probe_started = self._clock()
                return True
            return False

    def record_success(self) -> None:
        with self._lock:
            self._state = "closed"
            self._consecutive = 0
            self._probe_in_flight = False
            self._current_reset = self.reset_seconds

    def record_failure(self) -> None:
        with self._lock:
            self._consecutive += 1
            if self._state == "half_open":
                # The probe failed: stay away longer this time.
                self._current_reset = min(self._current_reset * 2, self.max_reset_seconds)
                self._open()
            elif self._state == "closed" and self._consecutive >= self.failures:
                self._open()

    def trip(self) -> None:
        """Open now, whatever the count: a failed reachability probe says the
        remote is down before any call has had to time out against it."""
        with self._lock:
            if self._state != "open":
                self._open()

    def _open(self) -> None:
        self._state = "open"
        self._opened_at = self._clock()
        self._probe_in_flight = False
        self.opened_total += 1

    def _maybe_half_open(self) -> None:
        if self._state == "open" and self._clock() - self._opened_at >= self._current_reset:
            self._state = "half_open"
            self._probe_in_flight = False
