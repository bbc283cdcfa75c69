"""Map a shared segment's pages into this process ahead of use.

Why: ``posix_fallocate`` gives the arena's segment its pages, but each
process that maps it still takes one page fault per 4 KiB page on first
touch, to fill its page table. On the VMs the benchmarks run on, that cost
76 ms per 128 MiB written (104 ms for the first copy into a fresh mapping,
28 ms for the second; 9.5 ms to populate the same range up front: see
``docs/benchmarks.md``, "Prefaulted arena"). The first copies are exactly
the ones that matter: a new replica promoting its first prompt from the
shared tier into L1 (the sidecar writes fresh pages) and copying it into
vLLM's KV cache (the worker reads fresh pages of its own mapping).

How: a daemon thread asks the kernel to populate the mapping step by step
(``madvise(MADV_POPULATE_WRITE)``, Linux 5.14, madvise(2)); the call runs
through ctypes, which releases the GIL, so the process's other threads
carry on. It never changes the segment's bytes: the pages exist already
(the creator reserved them), populating only maps them. A kernel without
the flag answers ``EINVAL`` and the mapping stays as it was (faults on
first touch, as before). ``stop`` ends the thread between steps, and the
owner of the mapping calls it before unmapping: a populate of an address
range unmapped meanwhile could reach whatever is mapped there next.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import threading
from collections.abc import Callable

__all__ = ["MADV_POPULATE_WRITE", "PREFAULT_STEP_BYTES", "Prefaulter", "populate"]

logger = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23  # include/uapi/asm-generic/mman-common.h
# One madvise call: small enough that stop() returns within one step (a few
# ms), large enough that the calls cost nothing next to the faults they save.
PREFAULT_STEP_BYTES = 32 << 20

_libc: ctypes.CDLL | None = None


def _madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """libc's madvise with its argument types, or None where there is no libc."""
    global _libc
    if os.name != "posix":
        return None
    if _libc is None:
        try:
            _libc = ctypes.CDLL(None, use_errno=True)
        except OSError:
            return None
    func = getattr(_libc, "madvise", None)
    if func is None:
        return None
    func.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    func.restype = ctypes.c_int
    return func


class Prefaulter:
    """Populates ``size`` bytes mapped at ``address`` on a background thread.

    ``done`` is set once every step was populated; ``supported`` turns
    False when the kernel refused the flag (then ``done`` is never set).
    """

    def __init__(self, address: int, size: int, name: str) -> None:
        self.address = address
        self.size = size
        self.done = threading.Event()
        self.supported = True
        self.populated_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"kvstrata-prefault-{name}", daemon=True
        )

    def start(self) -> Prefaulter:
        self._thread.start()
        return self

    def stop(self) -> None:
        """End the thread after its current step and wait for it."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        self.supported = populate(self.address, self.size, self._stop, self._progress)
        if self.supported and self.populated_bytes == self.size:
            self.done.set()

    def _progress(self, populated: int) -> None:
        self.populated_bytes = populated


def populate(
    address: int,
    size: int,
    stop: threading.Event | None = None,
    progress: Callable[[int], None] | None = None,
) -> bool:
    """Populate ``size`` bytes mapped at ``address`` now, in the calling thread,
    step by step (``stop`` ends it between steps; ``progress`` hears the bytes
    done after each). False when the kernel cannot (no ``MADV_POPULATE_WRITE``,
    or no libc): the mapping then faults on first touch, as without it."""
    madvise = _madvise()
    if madvise is None:
        return False
    for offset in range(0, size, PREFAULT_STEP_BYTES):
        if stop is not None and stop.is_set():
            return True
        length = min(PREFAULT_STEP_BYTES, size - offset)
        if madvise(address + offset, length, MADV_POPULATE_WRITE) != 0:
            err = ctypes.get_errno()
            if err in (errno.EINVAL, errno.ENOSYS):
                logger.info("this kernel cannot populate the arena ahead of use")
                return False
            logger.warning(
                "populating the arena's pages stopped at byte %d: %s", offset, os.strerror(err)
            )
            return True
        if progress is not None:
            progress(offset + length)
    return True
