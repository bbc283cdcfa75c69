"""Reused buffers for the ciphertext of objects sealed on their way to the
shared tier (Valkey values, S3 objects; an L2 file is sealed straight into
its direct write's buffer and needs none).

Why a module of its own: a sealed object needs a buffer as large as its
payload for the ciphertext, where a plaintext one is sent straight from the
L1 arena. Freshly allocated, a chunk-sized buffer (MiBs) comes from the
kernel page by page, and those page faults cost more than the AES-GCM
itself (measured: 0.72 ns/B sealing 8 fresh 16 MiB objects, 0.16 ns/B into
memory used before; AES-GCM alone about 0.10 ns/B). So the tiers that send
a sealed object and know when the sending is over give its buffer back, and
the next seal reuses it.

State: free buffers, at most ``max_bytes`` of them in all, the ones given
back last (the oldest go to the garbage collector first: when the chunk
size changes, a new model or a 32 MiB batch after 16 MiB ones, the pool
fills with the new size instead of holding on to buffers nothing takes);
a buffer is handed out to one object at a time. What is kept is never
more than the writes in flight at once already needed: the pool holds the
peak, it does not add to it. A buffer is given back only by the thread
that sent its object, once the send returned (the Valkey tier after its
pipeline, the S3 tier on the upload's own thread), so no send still reads
a buffer another seal writes.
"""

from __future__ import annotations

import threading

__all__ = ["SealBuffers"]

DEFAULT_MAX_BYTES = 256 << 20


class SealBuffers:
    """A bounded free list of bytearrays (module docstring). Thread-safe."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._free: list[bytearray] = []
        self._free_bytes = 0
        self.reused_total = 0

    def take(self, nbytes: int) -> bytearray:
        """A buffer of at least ``nbytes`` (at most twice that, so a small
        object never holds a large buffer): a free one, else a new one."""
        with self._lock:
            best = None
            for i, buf in enumerate(self._free):
                if nbytes <= len(buf) <= 2 * nbytes and (
                    best is None or len(buf) < len(self._free[best])
                ):
                    best = i
            if best is not None:
                buf = self._free.pop(best)
                self._free_bytes -= len(buf)
                self.reused_total += 1
                return buf
        return bytearray(nbytes)

    def give(self, buf: bytearray) -> None:
        """``buf`` is no longer read by anyone: keep it for reuse, making room
        by letting the buffers given back longest ago go (one larger than
        the whole bound is not kept)."""
        if len(buf) > self.max_bytes:
            return
        with self._lock:
            self._free.append(buf)
            self._free_bytes += len(buf)
            while self._free_bytes > self.max_bytes:
                self._free_bytes -= len(self._free.pop(0))

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return self._free_bytes
