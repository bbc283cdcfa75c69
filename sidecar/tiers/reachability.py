"""Whether the shared tier answers: asked at start, and again until it does.

Why: a shared tier that cannot be reached costs vLLM nothing (the breaker
turns its calls into misses), so without this nothing would say so: the
sidecar would start, ``/readyz`` answer 200 and the tier stay empty for days.
At start the tier is asked once (:meth:`kvstrata.sidecar.tiers.base.Tier.probe`)
on a thread of its own, so a server that does not answer delays nothing; a
failure is a warning in the log, ``kvstrata_tier_degraded{tier}`` 1 and the
reason in ``/status`` (``tiers.NAME.degraded_reason``). ``/readyz`` stays 200:
the cache is never the source of truth. The question is asked again, at
doubling intervals, until the tier answers, which clears the degraded state
even when no request has reached the tier yet.
"""

from __future__ import annotations

import logging
import threading

from kvstrata.sidecar.tiers.base import Tier

logger = logging.getLogger(__name__)


class ReachabilityWatch:
    """Probe ``tier`` now and every ``retry_seconds`` (doubling, at most
    ``8 * retry_seconds``) until it answers or :meth:`close` is called."""

    def __init__(self, tier: Tier, retry_seconds: float) -> None:
        self._tier = tier
        self._retry_seconds = retry_seconds
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"kvstrata-{tier.name}-reachability", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)

    def _run(self) -> None:
        name = self._tier.name
        why = self._tier.probe()
        if why is None:
            logger.info("shared tier %s answers", name)
            return
        logger.warning(
            "shared tier %s cannot be reached at start (%s): the sidecar serves from L1 and "
            "L2 meanwhile, kvstrata_tier_degraded{tier=%r} is 1 until it answers",
            name,
            why,
            name,
        )
        wait = self._retry_seconds
        while not self._stop.wait(wait):
            why = self._tier.probe()
            if why is None:
                logger.warning("shared tier %s answers now; no longer degraded", name)
                return
            logger.debug("shared tier %s still unreachable: %s", name, why)
            wait = min(wait * 2, 8 * self._retry_seconds)
