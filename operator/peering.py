"""Which of several operator replicas reconciles: kopf peering options.

Why: the chart may run more than one replica so that the webhook keeps being
served while one pod is away. kopf's peering lets only the live peer with the
highest priority handle resources; the others pause their handlers (kopf's
admission server is not paused, so every replica keeps serving the webhook).
Peers of equal priority all pause ("possibly conflicting operators"), so each
replica needs its own priority: derived here from its pod's name, which the
chart passes through the downward API. Two names sharing a priority is a
chance of about 1 in 2**31 per pair; ``--priority`` sets one explicitly.
"""

from __future__ import annotations

import hashlib
import socket
from typing import Any


def priority_of(pod_name: str) -> int:
    """A stable, non-negative priority distinct (all but surely) for distinct pod names."""
    digest = hashlib.sha256(pod_name.encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


def run_options(peering: str, priority: int | None, pod_name: str | None) -> dict[str, Any]:
    """What ``kopf.run`` is given: standalone without a peering name, else that peering."""
    if not peering:
        return {"standalone": True}
    if priority is None:
        priority = priority_of(pod_name or socket.gethostname())
    return {"standalone": False, "peering_name": peering, "priority": priority}
