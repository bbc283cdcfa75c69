"""The L1 arena: one named POSIX shared-memory segment.

Why a named segment: the vLLM worker (the connector) maps the same bytes
(``/dev/shm/<name>``) and copies KV straight in and out of the slots the
sidecar leases, so no chunk ever crosses a socket.

Persisted state: the segment ``/dev/shm/<name>`` of exactly ``size`` bytes,
created with ``O_CREAT | O_EXCL`` and mode 0600, unlinked by :meth:`Arena.close`.
Its content has no header: the sidecar's index (in process memory) is the
only map of what lives where; a client learns offsets from leases.

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
import logging
import mmap
import os
import secrets

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"


class ArenaError(OSError):
    """The segment could not be created or mapped."""


def generate_name() -> str:
    """A fresh segment name, unique per process and call."""
    return f"kvstrata-{os.getpid()}-{secrets.token_hex(4)}"


def _check_name(name: str) -> None:
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"l1.shm_name: {name!r} is not a valid shared-memory segment name")


class Arena:
    """A shared-memory segment mapped read-write into this process.

    ``buffer`` is a writable memoryview of the whole segment. ``create``
    makes a new segment (the sidecar); :meth:`attach` maps an existing one
    (clients, tests).
    """

    def __init__(
        self,
        size: int,
        name: str | None = None,
        pin_memory: bool = False,
        *,
        create: bool = True,
    ) -> None:
        if size <= 0:
            raise ValueError(f"l1.size_bytes: arena size must be > 0, got {size}")
        self.name = name or generate_name()
        _check_name(self.name)
        self.path = os.path.join(SHM_DIR, self.name)
        self.size = size
        self.owner = create
        self.pinned = False
        self._closed = False
        fd = self._open(create)
        try:
            if create:
                os.ftruncate(fd, size)
            elif os.fstat(fd).st_size < size:
                raise ArenaError(f"segment {self.path} is smaller than {size} bytes")
            self._mmap = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError:
            if create:
                with contextlib.suppress(OSError):
                    os.unlink(self.path)
            raise
        finally:
            os.close(fd)
        self.buffer = memoryview(self._mmap)
        if pin_memory:
            self.pinned = self._pin()

    @classmethod
    def attach(cls, name: str, size: int | None = None) -> Arena:
        """Map an existing segment (never unlinks it on close)."""
        _check_name(name)
        if size is None:
            size = os.stat(os.path.join(SHM_DIR, name)).st_size
        return cls(size, name, create=False)

    def _open(self, create: bool) -> int:
        if not create:
            return os.open(self.path, os.O_RDWR)
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL
        try:
            return os.open(self.path, flags, 0o600)
        except FileExistsError:
            # A configured name survives a container restart (the pod's
            # /dev/shm outlives the process): the old segment is stale.
            logger.warning("replacing stale shared-memory segment %s", self.path)
            os.unlink(self.path)
            return os.open(self.path, flags, 0o600)

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

    def __enter__(self) -> Arena:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
