"""Limits how often the connector calls a sidecar that is not answering.

Why: the client bounds every call by its deadline, but a sidecar that is
absent or stalled still costs up to that deadline per call, and the
connector calls from inside vLLM's step loop. While the client is not
connected, :class:`RetryGate` lets one probe through per interval (the
interval doubles after each failed probe, up to ``MAX_FACTOR`` times the
base) and turns every other call into an immediate miss or dropped save;
once a probe reconnects, every call goes through again.
"""

from __future__ import annotations

import time

from kvstrata.connector.client import SidecarClient

MAX_FACTOR = 8


class RetryGate:
    def __init__(self, client: SidecarClient, interval_s: float) -> None:
        self.client = client
        self.base_s = interval_s
        self._interval_s = interval_s
        self._next_probe = 0.0

    def allow(self) -> bool:
        """True when a call should be made now (connected, or a probe is due)."""
        if self.client.available():
            self._interval_s = self.base_s
            return True
        now = time.monotonic()
        if now < self._next_probe:
            return False
        if self._next_probe:  # the previous probe failed: wait longer next time
            self._interval_s = min(self._interval_s * 2, self.base_s * MAX_FACTOR)
        self._next_probe = now + self._interval_s
        return True
