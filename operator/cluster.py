"""What reconcile asks of the API server (:class:`Cluster`) and what it says back (:class:`Event`).

Why a module of its own: every step of a reconcile pass (render and apply,
roll the workloads, check the shared tier, report) talks to the cluster
through this one small interface, so tests drive each step on an
in-memory cluster and the real one (:class:`kvstrata.operator.kube.KubeCluster`)
is the only place that speaks HTTP; the Events the steps collect are
recorded on the KVCache by the handlers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["Cluster", "Event"]


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
    """One Kubernetes Event a reconcile pass records on the KVCache."""

    type: str  # "Normal" | "Warning"
    reason: str
    message: str
