"""The API server's Kubernetes version, and whether it can run the injected sidecar.

Why this module exists: the sidecar is a native sidecar (an init container
with ``restartPolicy: Always``). That needs the ``SidecarContainers`` feature:
alpha and off in 1.28, beta and on by default from 1.29, GA in 1.33
(https://kubernetes.io/docs/concepts/workloads/pods/sidecar-containers/).
On a server without it the API server drops ``restartPolicy`` and then
refuses the pod for the sidecar's probes ("may not be set for init containers
without restartPolicy=Always"). 1.28 is out of upstream support (only the
newest three minors are: https://kubernetes.io/releases/), so 1.29 is the
floor: on an older server the webhook skips injection with a reason instead
of handing the API server a pod it will refuse.

The version comes from the server itself (``GET /version``), read on the
first webhook call and again after :data:`REFRESH_S`, so an upgraded control
plane is noticed without restarting the operator.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

MINIMUM = (1, 29)  # native sidecars on by default (SidecarContainers beta)
REFRESH_S = 300.0


@dataclass(frozen=True, slots=True)
class ServerVersion:
    major: int
    minor: int
    git_version: str

    @property
    def native_sidecars(self) -> bool:
        return (self.major, self.minor) >= MINIMUM


def parse_version(info: Mapping[str, Any]) -> ServerVersion:
    """The ``/version`` answer as numbers.

    Managed clusters report e.g. ``minor: "29+"`` (GKE, EKS); the digits are
    what counts. ``gitVersion`` (``v1.29.3-eks-...``) is the fallback.
    Raises :class:`ValueError` naming what it got when neither holds a version.
    """
    git_version = str(info.get("gitVersion") or "")
    major = re.match(r"\d+", str(info.get("major") or ""))
    minor = re.match(r"\d+", str(info.get("minor") or ""))
    if major and minor:
        return ServerVersion(int(major.group()), int(minor.group()), git_version)
    found = re.match(r"v?(\d+)\.(\d+)", git_version)
    if found:
        return ServerVersion(int(found.group(1)), int(found.group(2)), git_version)
    raise ValueError(f"the API server's /version has no version number: {dict(info)!r}")


def unsupported_reason(version: ServerVersion) -> str | None:
    """Why this server cannot run the sidecar, or None when it can."""
    if version.native_sidecars:
        return None
    floor = ".".join(map(str, MINIMUM))
    return (
        f"the API server is Kubernetes {version.git_version or f'{version.major}.{version.minor}'}"
        f"; the kvstrata sidecar is a native sidecar, which needs Kubernetes {floor} or later"
    )


class VersionCache:
    """The server's version, fetched at most once per :data:`REFRESH_S` (thread-safe).

    A failed fetch keeps the last version known; with none known yet,
    :meth:`reason` says the version could not be read (the pod is then
    skipped: injecting blind on a server that may refuse the pod would block
    it).
    """

    def __init__(
        self,
        fetch: Callable[[], Mapping[str, Any]],
        refresh_s: float = REFRESH_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._fetch = fetch
        self._refresh_s = refresh_s
        self._clock = clock
        self._lock = threading.Lock()
        self._version: ServerVersion | None = None
        self._fetched_at: float | None = None

    def reason(self) -> str | None:
        """None when the server runs native sidecars; else why the sidecar is not injected."""
        with self._lock:
            now = self._clock()
            if self._fetched_at is None or now - self._fetched_at >= self._refresh_s:
                try:
                    self._version = parse_version(self._fetch())
                    self._fetched_at = now
                except Exception as exc:
                    logger.warning("cannot read the API server's version: %s", exc)
                    if self._version is None:
                        return f"cannot read the API server's version: {exc}"
            assert self._version is not None
            return unsupported_reason(self._version)
