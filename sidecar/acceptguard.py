"""The accept guard: no accept in the sidecar fails for want of a descriptor.

Why: libzmq 4.3.5 (the one pyzmq 27 bundles) aborts the process when an
accept on an ``ipc://`` listener fails with EMFILE (``errno_assert`` in
``ipc_listener_t::accept``, ``src/ipc_listener.cpp``: EMFILE is not among
the errors it expects); its ``tcp://`` listener spins on the connection that
stays queued. Nothing Python does afterwards can stop that: libzmq accepts on
its own I/O threads. So the failure is taken out of ``accept`` itself:
``csrc/kvs_accept_guard.c`` wraps ``accept`` and ``accept4``, and on EMFILE
or ENFILE drops the pending connection on a spare descriptor it keeps and
answers EAGAIN (that file says how). Every listener of the process, libzmq's
and the sidecar's own, then sees "nothing to accept", never EMFILE.

The wrapper must come before the C library in symbol lookup, which only
``LD_PRELOAD`` at process start gives (a library loaded later, even with
``RTLD_GLOBAL``, comes after it). So :func:`preload` re-executes the sidecar
once, before it starts anything, with ``LD_PRELOAD`` naming the library; the
process keeps its id, its descriptors and its limits. In the re-executed
process :func:`preload` puts ``LD_PRELOAD`` back as it was, so processes the
sidecar starts do not inherit the guard.

Where the library is: installed beside this module by the install step
(``setup.py``, a C compiler is all it needs); in a source checkout without
it, built from ``csrc/`` on demand. Where neither works (an install without a
C compiler), or ``KVSTRATA_ACCEPT_GUARD=off``, the sidecar says so in a
warning and runs on the ZeroMQ endpoint's gate alone (:mod:`.zmqgate`),
which stops accepting at its cap but whose reaction is a margin, not a
guarantee.

What it dropped is counted per listening descriptor
(``kvstrata_connections_closed_total{reason="no_descriptor"}``).
"""

from __future__ import annotations

import ctypes
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from kvstrata.sidecar.transfer import csrc_build

__all__ = ["GuardState", "dropped", "library_path", "loaded", "preload"]

ENV_SWITCH = "KVSTRATA_ACCEPT_GUARD"  # "off": do not preload the guard
# Set for the re-executed process: the LD_PRELOAD it had before ("" for none).
_ENV_BEFORE = "KVSTRATA_ACCEPT_GUARD_LD_PRELOAD"


@dataclass(frozen=True, slots=True)
class GuardState:
    """Whether the guard is in force in this process, and if not, why."""

    loaded: bool
    why_not: str = ""


def _symbols() -> ctypes.CDLL:
    return ctypes.CDLL(None)  # the process's global scope, where a preload sits


def loaded() -> bool:
    """Whether the guard's ``accept`` is the one this process calls."""
    return hasattr(_symbols(), "kvs_accept_guard_dropped")


def dropped(listener_fd: int = -1) -> int:
    """Connections the guard dropped: all, or those of one listening descriptor."""
    if not loaded():
        return 0
    fn = _symbols().kvs_accept_guard_dropped
    fn.restype = ctypes.c_ulong
    fn.argtypes = [ctypes.c_int]
    return int(fn(listener_fd))


def library_path() -> tuple[Path | None, str]:
    """``(path, "")`` of the guard library, or ``(None, why not)``."""
    installed = Path(__file__).resolve().parent / csrc_build.ACCEPT_GUARD.filename
    if installed.is_file():
        return installed, ""
    csrc = csrc_build.repo_csrc_dir()
    if csrc is None or not (csrc / csrc_build.ACCEPT_GUARD.compiled[0]).is_file():
        return None, f"{installed} is missing (the install found no C compiler) and no csrc/"
    try:
        return csrc_build.build(csrc_build.ACCEPT_GUARD, csrc), ""
    except csrc_build.CSrcBuildError as exc:
        return None, f"{installed} is missing and building it failed: {exc}"


def preload() -> GuardState:
    """Re-execute this process with the guard preloaded, or say why it is not.

    Call it first thing, before any thread or descriptor is made: on success
    it does not return (``os.execv``). In the re-executed process it restores
    ``LD_PRELOAD`` and returns the state.
    """
    if _ENV_BEFORE in os.environ:  # this is the re-executed process
        before = os.environ.pop(_ENV_BEFORE)
        if before:
            os.environ["LD_PRELOAD"] = before
        else:
            os.environ.pop("LD_PRELOAD", None)
        if loaded():
            return GuardState(True)
        return GuardState(False, "the re-executed sidecar did not load it (LD_PRELOAD ignored)")
    if os.environ.get(ENV_SWITCH, "").lower() == "off":
        return GuardState(False, f"{ENV_SWITCH}=off")
    if loaded():  # preloaded by whoever started us
        return GuardState(True)
    path, why_not = library_path()
    if path is None:
        return GuardState(False, why_not)
    before = os.environ.get("LD_PRELOAD", "")
    env = dict(os.environ)
    env[_ENV_BEFORE] = before
    env["LD_PRELOAD"] = f"{path}:{before}" if before else str(path)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, env)
    raise AssertionError("unreachable")  # execve returns only by raising
