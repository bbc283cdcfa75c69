"""The L1 arena: one named POSIX shared-memory segment.

Why a named segment: the vLLM worker (the connector) maps the same bytes
(``/dev/shm/<name>``) and copies KV straight in and out of the slots the
sidecar leases, so no chunk ever crosses a socket.

Persisted state: the segment ``/dev/shm/<name>`` of exactly ``size`` bytes,
created with ``O_CREAT | O_EXCL`` and mode 0600, unlinked by :meth:`Arena.close`.
Its content has no header: the sidecar's index (in process memory) is the
only map of what lives where; a client learns offsets from leases.

Memory another process maps must never fault. A tmpfs hands out pages on
first touch, so a segment larger than the room ``/dev/shm`` has would map
fine and then kill the first process that writes past the free space with
SIGBUS -- vLLM's worker included. So the creator reserves every page up
front (``posix_fallocate``): too little room is an error at start naming
``l1.size_bytes`` and the free space (or, with ``l1.fit_to_shm``, a smaller
arena), never a signal later. Reserved pages also keep old mappings safe:
a client still mapping an unlinked segment reads and writes pages that exist.

Stale segments: a sidecar killed with SIGKILL cannot unlink its segment,
and in a pod ``/dev/shm`` (a memory emptyDir) outlives the container, so
each restart would leave one more arena's worth of memory behind. The
creator holds an exclusive ``flock`` on its segment for its whole life;
generated names start with a prefix owned by the endpoint the sidecar
serves (``kvstrata-<tag>-``), and a starting sidecar removes every segment
of its prefix that nobody holds locked (the kernel drops the lock of a
dead process, whatever killed it). A configured ``l1.shm_name`` is replaced
the same way, and refused while a live sidecar holds it.

We do not use ``multiprocessing.shared_memory``: its resource tracker
unlinks segments when *any* process that touched them exits, which would
pull the arena from under a live sidecar.

When torch is importable, CUDA is available and ``pin_memory`` is set, the
whole segment is registered as page-locked (``cudaHostRegister``), so
device copies from and to it run at full DMA speed. torch is imported
lazily, only then.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import logging
import mmap
import os
import secrets

from kvstrata.sidecar.prefault import Prefaulter

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
NAME_PREFIX = "kvstrata-"
MIN_SIZE = 1 << 20  # the config's lower bound of l1.size_bytes
FIT_ALIGN = 1 << 20  # a shrunk arena is a whole number of MiB
FIT_SPARE_FRACTION = 0.1  # room a shrunk arena leaves to other users of /dev/shm


class ArenaError(OSError):
    """The segment could not be created or mapped; the message names the field."""


def owner_prefix(owner: str) -> str:
    """The segment-name prefix a sidecar serving ``owner`` (its endpoint) owns.

    Stable across restarts of the same sidecar, different for sidecars of
    different endpoints sharing one ``/dev/shm``.
    """
    tag = hashlib.sha256(owner.encode()).hexdigest()[:8]
    return f"{NAME_PREFIX}{tag}-"


def generate_name(prefix: str = NAME_PREFIX) -> str:
    """A fresh segment name under ``prefix``, unique per process and call."""
    return f"{prefix}{os.getpid()}-{secrets.token_hex(4)}"


def shm_free_bytes() -> int:
    """Bytes ``/dev/shm`` can still hand out (its filesystem's free space)."""
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def _unlink_if_unlocked(path: str) -> bool:
    """Unlink ``path`` unless a live process holds its flock; True if removed."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # its sidecar is alive
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return True
    finally:
        os.close(fd)  # drops our lock too


def remove_stale(prefix: str) -> list[str]:
    """Unlink every segment named ``prefix*`` that no live process holds locked.

    Returns the names removed. Only the sidecar owning ``prefix`` calls this.
    """
    removed: list[str] = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    for name in sorted(names):
        if name.startswith(prefix) and _unlink_if_unlocked(os.path.join(SHM_DIR, name)):
            removed.append(name)
    if removed:
        logger.warning("removed %d stale arena segment(s): %s", len(removed), ", ".join(removed))
    return removed


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def fit_size(size: int, free: int, fit: bool) -> int:
    """The arena size to create in ``free`` bytes of ``/dev/shm``.

    ``size`` when it fits; otherwise, with ``fit``, the whole MiB that leave
    :data:`FIT_SPARE_FRACTION` of the room to others; else :class:`ArenaError`
    naming ``l1.size_bytes`` and the free space.
    """
    if size <= free:
        return size
    shrunk = int(free * (1 - FIT_SPARE_FRACTION)) // FIT_ALIGN * FIT_ALIGN
    if fit and shrunk >= MIN_SIZE:
        logger.warning(
            "l1.size_bytes: %d bytes do not fit in %s (%s free); "
            "l1.fit_to_shm is set, so the arena is %s",
            size,
            SHM_DIR,
            _mib(free),
            _mib(shrunk),
        )
        return shrunk
    hint = "" if fit else "; enlarge /dev/shm or set l1.fit_to_shm to shrink the arena"
    raise ArenaError(
        errno.ENOSPC,
        f"l1.size_bytes: {size} bytes ({_mib(size)}) do not fit in {SHM_DIR}, "
        f"which has {free} bytes ({_mib(free)}) free{hint}",
    )


def _check_name(name: str) -> None:
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"l1.shm_name: {name!r} is not a valid shared-memory segment name")


class Arena:
    """A shared-memory segment mapped read-write into this process.

    ``buffer`` is a writable memoryview of the whole segment. ``create``
    makes a new segment (the sidecar): stale segments of ``prefix`` (one
    from :func:`owner_prefix`; None removes nothing) or of the configured
    ``name`` are removed first, every page is reserved, and
    ``size`` may end up smaller than asked only with ``fit_to_shm``.
    :meth:`attach` maps an existing one (clients, tests). Either way a
    background thread maps every page into this process ahead of use
    (:mod:`.prefault`) unless ``prefault`` is False or the segment is pinned.
    """

    def __init__(
        self,
        size: int,
        name: str | None = None,
        pin_memory: bool = False,
        *,
        create: bool = True,
        prefix: str | None = None,
        fit_to_shm: bool = False,
        prefault: bool = True,
    ) -> None:
        if size <= 0:
            raise ValueError(f"l1.size_bytes: arena size must be > 0, got {size}")
        self.name = name or generate_name(prefix or NAME_PREFIX)
        _check_name(self.name)
        self.path = os.path.join(SHM_DIR, self.name)
        self.owner = create
        self.pinned = False
        self._closed = False
        self._lock_fd = -1
        if create:
            if name is None and prefix is not None:
                remove_stale(prefix)
            elif not _unlink_if_unlocked(self.path) and os.path.exists(self.path):
                raise ArenaError(
                    errno.EBUSY, f"l1.shm_name: segment {self.path} is in use by a running sidecar"
                )
            size = fit_size(size, shm_free_bytes(), fit_to_shm)
        self.size = size
        fd = self._open(create)
        try:
            if create:
                self._reserve(fd, size)
            elif os.fstat(fd).st_size < size:
                raise ArenaError(f"segment {self.path} is smaller than {size} bytes")
            self._mmap = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError:
            os.close(fd)
            if create:
                with contextlib.suppress(OSError):
                    os.unlink(self.path)
            raise
        if create:
            self._lock_fd = fd  # held open: the flock says "this segment is alive"
        else:
            os.close(fd)
        self.buffer = memoryview(self._mmap)
        if pin_memory:
            self.pinned = self._pin()
        # Registering as pinned memory maps every page already.
        self.prefaulter: Prefaulter | None = None
        if prefault and not self.pinned:
            self.prefaulter = Prefaulter(self.address(), size, self.name).start()

    @classmethod
    def attach(cls, name: str, size: int | None = None, *, prefault: bool = True) -> Arena:
        """Map an existing segment (never unlinks it on close); ``prefault``
        as for a new one (populated in the background)."""
        _check_name(name)
        if size is None:
            size = os.stat(os.path.join(SHM_DIR, name)).st_size
        return cls(size, name, create=False, prefault=prefault)

    def _open(self, create: bool) -> int:
        if not create:
            return os.open(self.path, os.O_RDWR)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise
        return fd

    def _reserve(self, fd: int, size: int) -> None:
        """Size the segment and allocate every page now (ENOSPC here, not SIGBUS later)."""
        os.ftruncate(fd, size)
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                # A filesystem without fallocate: touch every page instead.
                self._touch_pages(fd, size)
                return
            free = shm_free_bytes()
            raise ArenaError(
                exc.errno,
                f"l1.size_bytes: cannot reserve {size} bytes ({_mib(size)}) in {SHM_DIR}: "
                f"{exc.strerror} ({free} bytes, {_mib(free)}, free)",
            ) from None

    @staticmethod
    def _touch_pages(fd: int, size: int) -> None:
        step = 1 << 20
        zeros = bytes(min(step, size))
        for offset in range(0, size, step):
            os.pwrite(fd, zeros[: min(step, size - offset)], offset)

    def address(self) -> int:
        """The virtual address of the segment's first byte in this process."""
        view = (ctypes.c_char * self.size).from_buffer(self._mmap)
        try:
            return ctypes.addressof(view)
        finally:
            del view

    def _pin(self) -> bool:
        try:
            import torch
        except ImportError:
            return False
        try:
            if not torch.cuda.is_available():
                return False
            err = torch.cuda.cudart().cudaHostRegister(self.address(), self.size, 0)
        except Exception:  # a broken CUDA install costs pinning, not the sidecar
            logger.exception("cudaHostRegister failed; the arena stays pageable")
            return False
        if int(err) != 0:
            logger.warning("cudaHostRegister returned %s; the arena stays pageable", err)
            return False
        logger.info("arena %s (%d bytes) registered as pinned memory", self.name, self.size)
        return True

    def _unpin(self) -> None:
        try:
            import torch

            torch.cuda.cudart().cudaHostUnregister(self.address())
        except Exception:
            logger.exception("cudaHostUnregister failed")
        self.pinned = False

    def close(self) -> None:
        """Unmap (when no view is left) and, for the creator, unlink the segment."""
        if self._closed:
            return
        self._closed = True
        if self.prefaulter is not None:
            self.prefaulter.stop()  # before the unmap (see .prefault)
        if self.pinned:
            self._unpin()
        with contextlib.suppress(BufferError):
            self.buffer.release()
        try:
            self._mmap.close()
        except BufferError:
            # Views handed out (tensors, slices) still exist; the mapping goes
            # away with them. Unlinking below already frees the name.
            logger.debug("arena %s still has exported views; unmapping deferred", self.name)
        if self.owner:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    def __enter__(self) -> Arena:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
