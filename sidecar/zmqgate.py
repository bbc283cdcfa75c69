"""The ZeroMQ endpoint's door: stop accepting connections at the endpoint's cap,
so that ZeroMQ leaves descriptors to L2 files, tiers and the other listeners.

Safety against running out is not this module's: the accept guard
(:mod:`.acceptguard`, preloaded) answers an accept short of a descriptor
with EAGAIN and drops that connection, whatever the door does. The door
bounds ZeroMQ's share; it was once the only protection, as follows, and is
again where the guard is missing (an install without a C compiler).

Why: libzmq 4.3.5 (the one pyzmq 27 bundles) accepts every connection that
reaches an ``ipc://`` listener as soon as it arrives, and treats an
``accept`` that fails for want of a descriptor as a bug:
``ipc_listener_t::accept`` (``src/ipc_listener.cpp``) checks the ``errno``
of a failed ``accept4`` with ``errno_assert`` against EAGAIN, EWOULDBLOCK,
EINTR, ECONNABORTED, EPROTO and ENFILE. EMFILE (the process's own limit) is
not among them, so the assertion fails and ``zmq_abort`` ends the process
with SIGABRT: "Too many open files (src/ipc_listener.cpp:297)". No socket
option caps the connections of a ROUTER, and ``zmq_unbind`` is no pause:
the connections accepted from a listener are its children, so unbinding
closes every one of them, the well-behaved clients' too.

So the sidecar owns the door, a file name. libzmq binds the endpoint's
path as usual; while no more connections may be accepted, the socket file is
renamed into a private directory beside it (``.<name>.gate``, mode 0700:
nobody reaches it there), and renamed back when they may again. ``connect``
resolves the name to the socket, so while the name is away newcomers get
ENOENT, as from a sidecar not started yet, and retry; the socket itself, and
every connection libzmq holds, is untouched by a rename. A monitor of the
ROUTER (``ZMQ_EVENT_ACCEPTED`` and ``ZMQ_EVENT_DISCONNECTED``, each carrying
the connection's descriptor) lets the gate's thread count the connections,
and the door shuts when

* the connections reach the ``zmq`` cap of :mod:`.fdbudget`, or
* the process is short of descriptors: an accepted descriptor numbered at
  or above ``ListenerCounts.fd_ceiling`` says so at once (``accept`` takes
  the lowest free number), and the count of open descriptors is read every
  :data:`CHECK_S` besides;

and opens again once connections have closed and descriptors are free.

What holds, and what does not: once the name is gone, no new connection
reaches libzmq (a ``connect`` waiting for room in the backlog looks the name
up again: ``unix_stream_connect`` in ``net/unix/af_unix.c``); libzmq still
accepts what was queued (at most :data:`BACKLOG`) and what arrived while the
gate's thread was waking to the event. That last part is a race the gate
cannot win by construction, only by margin: half the reserve of
:mod:`.fdbudget` is kept for it, the HTTP port and the liveness socket keep
no connection there, and, without the guard, the process hands the GIL
over every 0.5 ms (``kvstrata.sidecar.main``), so the thread reacts within
a few hundred accepts even while other threads run Python. (With the guard
the interval stays Python's 5 ms: a flood may then outrun the thread, which
costs the flood's connections, not the process; the door still shuts once
the monitor's events are read.) Through a hard link to the socket file,
made while the door is open, a client reaches the socket whatever the door
does: only the guard holds against that. Measured on 2 shared cores
with 1,100 ZeroMQ, 700 HTTP and 700 liveness connections at once from three
processes: under ``prlimit --nofile=1024:1024`` (a cap of 83) libzmq
accepted 17 to 29 connections past the cap before the door shut, the sidecar
holding at most 526 descriptors; with the limit lowered to 512 while running
(a cap of 40), 27 to 219 past it, at most 438 descriptors. The worst seen,
233 past the cap, came while the machine was busier. The margin held in
every run then; it is a margin, not a proof (a loaded CI machine outran it
twice later). A limit lowered while the sidecar runs
is read every :data:`CHECK_S` and shrinks every listener's cap
(:func:`.fdbudget.replan`); a limit lowered below what the process already
holds closes the door at that check.

Not gated: ``ipc://@NAME`` (an abstract socket has no file to move), and
``tcp://`` (libzmq's TCP accept takes EMFILE as a failed accept, not an
assertion).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
from typing import Any

import zmq

from kvstrata.sidecar.fdbudget import ListenerCounts, nofile_limit, open_descriptors, replan

__all__ = ["BACKLOG", "CHECK_S", "ConnectionGate"]

logger = logging.getLogger(__name__)

BACKLOG = 32  # ZMQ_BACKLOG: connections queued on the listener, accepted even with the door shut
CHECK_S = 0.1  # how often the limit and the descriptors in use are read
HEADROOM_MIN = 2 * BACKLOG  # descriptors kept free for what libzmq accepts after the door shuts
_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_MONITOR_STOPPED


def _private_dir(public: str) -> str:
    head, name = os.path.split(public)
    return os.path.join(head or ".", f".{name}.gate")


class ConnectionGate:
    """The door of one ``ipc://PATH`` endpoint (module docstring).

    Life cycle: :meth:`prepare` before libzmq binds the endpoint's path,
    :meth:`start` once it is bound (the door is open, the thread starts),
    :meth:`close`. ``counts`` holds every listener's counts: the ZeroMQ one
    is this gate's (``/metrics``), and all are re-capped when the limit changes.
    """

    def __init__(
        self,
        public_path: str,
        counts: dict[str, ListenerCounts],
    ) -> None:
        self.public_path = public_path
        self.all_counts = counts
        self.counts = counts["zmq"]
        self._dir: str | None = None
        self._private: str | None = None
        self._open = False
        self._fds: set[int] = set()  # the descriptors of the connections libzmq holds
        self._nofile = nofile_limit()
        self._sock: zmq.Socket[Any] | None = None
        self._monitor: zmq.Socket[Any] | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    @property
    def accepting(self) -> bool:
        return self._open

    def prepare(self) -> None:
        """Make the private directory (anew: a killed sidecar may have left one)."""
        self._dir = _private_dir(self.public_path)
        shutil.rmtree(self._dir, ignore_errors=True)
        os.mkdir(self._dir, 0o700)
        self._private = os.path.join(self._dir, "zmq.sock")

    def start(self, sock: zmq.Socket[Any]) -> None:
        """``sock`` is bound to the endpoint's path: the door is open; watch."""
        self._sock = sock
        self._monitor = sock.get_monitor_socket(_EVENTS)
        self._open = True
        self._thread = threading.Thread(target=self._run, name="kvstrata-zmq-gate", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop watching and remove both names (before the socket is closed)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self._sock is not None and self._monitor is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._sock.disable_monitor()
            self._monitor.close(0)
            self._monitor = None
        self._remove()

    # -- the gate's thread ---------------------------------------------------

    def _run(self) -> None:
        monitor = self._monitor
        assert monitor is not None  # start() made it before the thread
        while not self._stop.is_set():
            try:
                if monitor.poll(int(CHECK_S * 1000)):
                    self._drain(monitor)
                self._check()
            except zmq.ZMQError as exc:
                if self._stop.is_set():
                    return
                logger.warning("zmq gate: %s", exc)
            except Exception:  # the door must never stay in a state nobody watches
                logger.exception("zmq gate check failed")

    def _drain(self, monitor: zmq.Socket[Any]) -> None:
        """Read every event waiting (``[event id and value, endpoint]`` frames)."""
        while True:
            try:
                frames = monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            event = int.from_bytes(frames[0][:2], "little")
            value = int.from_bytes(frames[0][2:6], "little")
            if event == zmq.EVENT_ACCEPTED:
                self._fds.add(value)
                self.counts.open = len(self._fds)
                if self._open and value >= self.counts.fd_ceiling:
                    self._close_door(f"descriptor {value} of {self._nofile}: few left")
                elif self._open and self.counts.open >= self.counts.limit:
                    self._close_door(f"{self.counts.open} connections, the cap")
            elif event == zmq.EVENT_DISCONNECTED:
                self._fds.discard(value)
                self.counts.open = len(self._fds)
            elif event == zmq.EVENT_MONITOR_STOPPED:
                self._stop.set()
                return

    def _check(self) -> None:
        """Re-read the limit and the descriptors in use; shut or open the door."""
        nofile = nofile_limit()
        if nofile != self._nofile:
            budget = replan(self.all_counts, nofile)
            logger.warning(
                "file descriptor limit now %d (was %d): connection caps http %d, "
                "liveness %d, zmq %d",
                nofile, self._nofile, budget.http, budget.liveness, budget.zmq,
            )  # fmt: skip
            self._nofile = nofile
        headroom = nofile - self.counts.fd_ceiling
        free = nofile - open_descriptors()
        at_cap = self.counts.open >= self.counts.limit
        if self._open and (at_cap or free < headroom):
            self._close_door(f"{free} descriptors free, {self.counts.open} connections")
        elif not self._open and not at_cap and free >= headroom + BACKLOG:
            self._open_door()

    # -- the door ------------------------------------------------------------

    def _open_door(self) -> None:
        """Put the socket back under the endpoint's name."""
        assert self._private is not None  # prepare() ran
        os.rename(self._private, self.public_path)
        self._open = True
        logger.info("zmq: accepting connections again (%d open)", self.counts.open)

    def _close_door(self, why: str) -> None:
        """Move the socket out of reach (connections already made stay)."""
        if not self._open:
            return
        assert self._private is not None  # prepare() ran
        # (A name removed behind our back: nothing reaches the socket anyway.)
        with contextlib.suppress(FileNotFoundError):
            os.rename(self.public_path, self._private)
        self._open = False
        self.counts.paused += 1
        logger.warning("zmq: not accepting connections (%s) until some close", why)

    def _remove(self) -> None:
        for name in (self.public_path, self._private):
            if name is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
