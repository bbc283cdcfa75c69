"""Which local processes may open a session: the kernel's word, not the client's.

Why: in host mode a session maps the whole L1 arena read-write, so HELLO is
the door to every tenant's KV in this sidecar. The ``ipc://`` socket file's
mode and group keep out processes that cannot open it; this keeps out those
that can but are not the vLLM the sidecar serves.

On an ``ipc://`` endpoint libzmq reads the connecting process's credentials
with ``SO_PEERCRED`` and appends them to the connection's ``Peer-Address``
metadata as ``:uid:gid:pid``; unlike the ``pid`` a HELLO body names, they
cannot be forged. :class:`ClientAdmission` decides on the uid:

* ``server.client_uids`` set: only those uids may say HELLO.
* unset (the default): one client per sidecar -- the uid of the first
  process to say HELLO is the only one admitted for the life of the sidecar
  (a vLLM pod's scheduler and workers share a uid; a restarted vLLM keeps it).

A ``tcp://`` endpoint carries no credentials: there the pod's network
namespace (loopback) or ZeroMQ CURVE keys are the boundary, and
``server.client_uids`` is refused by the config loader.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["ClientAdmission", "PeerCredentials", "credentials_from_peer_address"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PeerCredentials:
    """What the kernel says of the process at the other end of a socket.

    ``pid`` is 0 when that process lives in a PID namespace this one cannot
    see (another container of the pod without a shared process namespace)."""

    uid: int
    gid: int
    pid: int


def credentials_from_peer_address(address: str | None) -> PeerCredentials | None:
    """The ``:uid:gid:pid`` suffix libzmq appends to an ipc peer's address, or
    None where there is none (tcp, or a libzmq built without SO_PEERCRED)."""
    if not address:
        return None
    parts = address.rsplit(":", 3)
    if len(parts) != 4:
        return None
    try:
        uid, gid, pid = (int(x) for x in parts[1:])
    except ValueError:
        return None
    if min(uid, gid, pid) < 0:
        return None
    return PeerCredentials(uid, gid, pid)


class ClientAdmission:
    """The uid policy for HELLO (module docstring). Thread-safe."""

    def __init__(self, allowed_uids: Iterable[int] | None) -> None:
        self._allowed: frozenset[int] | None = (
            frozenset(allowed_uids) if allowed_uids is not None else None
        )
        self._configured = allowed_uids is not None
        self._lock = threading.Lock()
        self._logged: set[int] = set()  # uids whose refusal was logged at WARNING
        self.refused_total = 0

    @property
    def allowed_uids(self) -> frozenset[int] | None:
        """The admitted uids; None until the first client fixes them (default)."""
        with self._lock:
            return self._allowed

    def refusal(self, peer: PeerCredentials | None) -> str | None:
        """None if ``peer`` may open a session, else why not (for its error
        reply). A peer without credentials is judged only where uids were
        configured: there it is refused, since it cannot be checked."""
        with self._lock:
            if peer is None:
                if self._configured:
                    self.refused_total += 1
                    return "the peer's credentials are unknown; server.client_uids needs them"
                return None
            if self._allowed is None:
                self._allowed = frozenset({peer.uid})
                logger.info(
                    "sessions limited to uid %d, the first client's "
                    "(server.client_uids admits others)",
                    peer.uid,
                )
                return None
            if peer.uid in self._allowed:
                return None
            self.refused_total += 1
            allowed = sorted(self._allowed)
            first = peer.uid not in self._logged
            self._logged.add(peer.uid)
        # Once per uid at WARNING: a client retrying in a loop must not flood the log.
        logger.log(
            logging.WARNING if first else logging.DEBUG,
            "refused HELLO from uid %d (pid %d): this sidecar admits uid %s (server.client_uids)",
            peer.uid,
            peer.pid,
            ", ".join(map(str, allowed)),
        )
        return (
            f"uid {peer.uid} may not open a session here "
            f"(admitted: {', '.join(map(str, allowed))}; see server.client_uids)"
        )
