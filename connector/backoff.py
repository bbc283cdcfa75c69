"""The client's one retry policy: how long calls answer at once after the sidecar did not answer.

Why a module of its own: every call of
:class:`~kvstrata.connector.client.SidecarClient` passes through the same
window. After a call the sidecar did not answer (unreachable, timed out,
HELLO refused) calls answer None/False at once for ``min_s``; each further
miss doubles the window up to ``max_s``; any answered call ends it. A
stalled sidecar thus costs a caller one deadline per window, and the cap
bounds how long a sidecar that is back waits for its first call.
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["BACKOFF_MAX_S", "BACKOFF_MIN_S", "Backoff"]

BACKOFF_MIN_S = 0.1
BACKOFF_MAX_S = 4.0


class Backoff:
    """The back-off window, read from ``clock``: its own clock (call deadlines
    use the real one), so a test can step through the windows instead of
    timing them."""

    def __init__(
        self,
        min_s: float = BACKOFF_MIN_S,
        max_s: float = BACKOFF_MAX_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 < min_s <= max_s:
            raise ValueError(f"bad back-off {min_s}..{max_s} s")
        self.min_s = float(min_s)
        self.max_s = float(max_s)
        self._clock = clock
        self._window_s = self.min_s
        self._retry_at = 0.0

    def waiting(self) -> bool:
        """Inside the window: a call answers at once, without I/O."""
        return self._clock() < self._retry_at

    def missed(self) -> None:
        """The sidecar did not answer: open a window, twice as long (up to the
        cap) as the last one."""
        self._retry_at = self._clock() + self._window_s
        self._window_s = min(self.max_s, self._window_s * 2)

    def answered(self) -> None:
        """The sidecar answered: the next miss opens the shortest window again."""
        self._window_s = self.min_s
        self._retry_at = 0.0
