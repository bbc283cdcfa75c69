"""File descriptors: raise the process's limit, and share it so ZeroMQ never runs out.

Why: every connection costs a descriptor, and the HTTP port (reachable on
the pod IP), the liveness socket and the ZeroMQ endpoint accept connections
from whoever can reach them. libzmq does not survive running out: an accept
that fails with ``EMFILE`` on its ``ipc://`` listener is an assertion, and
the assertion aborts the whole process (``src/ipc_listener.cpp``, libzmq
4.3; :mod:`.acceptguard` takes that failure out of ``accept`` itself, and
:mod:`.zmqgate` caps ZeroMQ's connections). So:

* at start the soft ``RLIMIT_NOFILE`` is raised to the hard limit (the
  kernel allows an unprivileged process that much; containers often start
  with a soft 1,024 under a hard 1,048,576);
* of the descriptors still free once the engine is up, a reserve (half,
  at least :data:`RESERVE_MIN`) is never handed to a listener: it
  is what L2 files, tier connections and the connections libzmq accepts
  before its endpoint stops accepting draw from. The kernel hands out the
  lowest free descriptor number, so a connection accepted on a number in
  the reserve (``ListenerCounts.fd_ceiling``) says at once, with no count
  to lag behind, that the rest is nearly used: the HTTP port and the
  liveness socket close it on the spot;
* the rest is split in three shares, one each for the HTTP port and the
  liveness socket and half of one for the ZeroMQ endpoint, as their
  connection caps (each at most its own ceiling). The HTTP port and the liveness socket at
  their caps close their oldest connection that is still idle to let a
  newcomer in (so a health probe is served however many idle connections
  are held), or refuse the newcomer; the ZeroMQ endpoint stops accepting
  until connections close (:mod:`.zmqgate`);
* the limit is read again while the sidecar runs (:func:`replan`): one
  lowered by ``prlimit`` shrinks the caps.

:class:`ListenerCounts` is what each listener reports (``/metrics``:
``kvstrata_connections_*``).
"""

from __future__ import annotations

import logging
import os
import resource
from dataclasses import dataclass

__all__ = [
    "FdBudget",
    "ListenerCounts",
    "nofile_limit",
    "open_descriptors",
    "plan",
    "raise_nofile_limit",
    "replan",
]

logger = logging.getLogger(__name__)

RESERVE_MIN = 64  # descriptors kept for ZeroMQ, files and tiers, whatever the limit
HTTP_CEILING = 1024  # scrapers and probes: a handful in practice
LIVENESS_CEILING = 4096  # one per client process (scheduler and workers)
ZMQ_CEILING = 4096  # one per client process, and a few for reconnects
ZMQ_FLOOR = 32  # a tensor-parallel vLLM's processes, however low the limit
LISTENER_FLOOR = 8  # a listener always takes this many, however low the limit
# What an unlimited limit counts as (the kernel's fs.nr_open default caps
# what setrlimit takes anyway).
UNLIMITED = 1 << 20


def _finite(limit: int) -> int:
    return UNLIMITED if limit == resource.RLIM_INFINITY else int(limit)


@dataclass
class ListenerCounts:
    """What one listener did with its connections (read by the metrics collector;
    each field is written by the listener's own thread only)."""

    limit: int  # the connection cap
    # A connection accepted on a descriptor numbered this high or higher is
    # closed at once: the descriptors above are the reserve (module docstring).
    fd_ceiling: int = UNLIMITED
    open: int = 0
    refused: int = 0  # newcomers closed at once: at the cap, no idle connection to close
    made_room: int = 0  # idle connections closed to let a newcomer in
    idle_closed: int = 0  # connections closed at their idle deadline
    accept_errors: int = 0  # accept() failures (EMFILE, ...): each pauses accepting
    paused: int = 0  # times accepting stopped at the cap or short of descriptors (zmq)
    listen_fd: int = -1  # the listening descriptor (http, liveness): the accept guard's key


@dataclass(frozen=True, slots=True)
class FdBudget:
    """How the descriptors of the process are shared (module docstring)."""

    nofile: int  # the soft limit in force
    in_use: int  # open when the budget was made
    reserve: int
    http: int  # connection cap of the HTTP port
    liveness: int  # connection cap of the liveness socket
    zmq: int  # connection cap of the ZeroMQ endpoint

    def fd_ceiling(self, listener: str) -> int:
        """The descriptor number from which ``listener`` keeps no new connection
        (the same for all three): the upper half of the reserve is left to
        what libzmq accepts before its endpoint stops accepting (.zmqgate), the
        lower half to connections that make room at a cap."""
        del listener  # one line for every listener
        return self.nofile - self.reserve // 2


def raise_nofile_limit() -> int:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard one; the soft limit in force.

    An unlimited hard limit counts as :data:`UNLIMITED`."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, UNLIMITED)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            logger.info("file descriptor limit raised from %d to %d", soft, target)
            soft = target
        except (ValueError, OSError) as exc:
            logger.warning("cannot raise the file descriptor limit from %d: %s", soft, exc)
    return _finite(soft)


def nofile_limit() -> int:
    """The soft ``RLIMIT_NOFILE`` in force now (it may be lowered while we run)."""
    return _finite(resource.getrlimit(resource.RLIMIT_NOFILE)[0])


def open_descriptors() -> int:
    """How many descriptors the process has open now."""
    for fd_dir in ("/proc/self/fd", "/dev/fd"):
        try:
            return len(os.listdir(fd_dir))
        except OSError:
            continue
    return 0


def plan(nofile: int | None = None, in_use: int | None = None) -> FdBudget:
    """The budget for a process with limit ``nofile`` and ``in_use`` descriptors
    open (both read from the process when not given)."""
    if nofile is None:
        nofile = nofile_limit()
    in_use = open_descriptors() if in_use is None else in_use
    free = max(0, nofile - in_use)
    reserve = max(RESERVE_MIN, free // 2)
    share = max(0, free - reserve) // 3
    http = max(LISTENER_FLOOR, min(HTTP_CEILING, share))
    liveness = max(LISTENER_FLOOR, min(LIVENESS_CEILING, share))
    # Half a share for ZeroMQ: a pod runs one client per vLLM process, far
    # fewer than that, and the other half widens the margin for what libzmq
    # accepts before its gate reacts (.zmqgate).
    zmq = max(ZMQ_FLOOR, min(ZMQ_CEILING, share // 2))
    return FdBudget(
        nofile=nofile, in_use=in_use, reserve=reserve, http=http, liveness=liveness, zmq=zmq
    )


def replan(counts: dict[str, ListenerCounts], nofile: int) -> FdBudget:
    """A new budget for limit ``nofile``, the listeners' own connections not
    counted as in use (they are what the caps share); sets each listener's cap."""
    held = sum(c.open for c in counts.values())
    budget = plan(nofile, max(0, open_descriptors() - held))
    for name, c in counts.items():
        c.limit = getattr(budget, name)
        c.fd_ceiling = budget.fd_ceiling(name)
    return budget
