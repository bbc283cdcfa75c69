"""What the operator's decisions need of a cluster, and the Events they report.

Why this module exists: reconcile and the workload rollout are plain
functions over :class:`Cluster` (the real one is
:class:`kvstrata.operator.kube.KubeCluster`; tests pass an in-memory one),
and both report :class:`Event` values the kopf handlers post. Kept apart so
that either module can use them without importing the other.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol


class Cluster(Protocol):
    """The few API calls reconcile makes; objects are plain dicts."""

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict | None: ...

    def apply(self, obj: Mapping[str, Any]) -> dict: ...

    def list(
        self, api_version: str, kind: str, namespace: str, label_selector: str | None = None
    ) -> list[dict]: ...

    def patch(
        self, api_version: str, kind: str, namespace: str, name: str, body: Mapping[str, Any]
    ) -> dict: ...

    def has_kind(self, api_version: str, kind: str) -> bool: ...


@dataclass(frozen=True, slots=True)
class Event:
    type: str  # "Normal" | "Warning"
    reason: str
    message: str
