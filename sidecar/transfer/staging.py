"""The staging copy path of one GPU: KV moved through a device buffer and the copy engines.

Why a module of its own: which of the two copy paths is faster depends on
the node (PCIe generation, GPU, how busy its SMs are), so the sidecar
chooses one (``ipc.copy_path``; ``kvstrata bench transfer`` measures
both). ``zero_copy`` is one kernel launch that reads and writes the pinned
arena over PCIe (:class:`~kvstrata.sidecar.transfer.cuda_device.CudaDevice`
runs it itself). ``staging``, here: the kernel moves the KV to or from a
buffer in device memory (``staging_bytes``, allocated at the first copy,
freed when the device closes) and the copy engines move each chunk between
that buffer and its arena slot (one ``cudaMemcpyAsync`` per chunk). Calls
with more chunks than the buffer holds run in batches on the device's one
stream, whose order keeps a batch from reusing the buffer before the
previous one left it. A call whose single chunk is larger than the buffer
runs zero-copy instead, with a warning once per device, counted in
:attr:`StagingCopies.fallbacks`: the buffer size is a speed setting, and
refusing REGISTER_KV over it would send the worker to host mode, slower
than either path.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

from kvstrata.sidecar.transfer.ipc_device import CudaDeviceError
from kvstrata.sidecar.transfer.kernel_binding import KernelError, TransferLibrary

if TYPE_CHECKING:
    from kvstrata.sidecar.transfer.plan import CopyPlan

__all__ = ["COPY_PATHS", "DEFAULT_STAGING_BYTES", "CopyPath", "StagingCopies", "check_copy_path"]

logger = logging.getLogger("kvstrata.sidecar.transfer.cuda_device")

CopyPath = Literal["zero_copy", "staging"]
COPY_PATHS: tuple[CopyPath, ...] = ("zero_copy", "staging")
DEFAULT_STAGING_BYTES = 256 << 20

# Each staged chunk starts on a 256-byte boundary, so a chunk size that is not a
# multiple of 16 does not push the kernel's accesses of every later chunk below
# 16 bytes (the width is chosen once per launch from every address).
_STAGING_ALIGN = 256


def check_copy_path(copy_path: str, staging_bytes: int) -> None:
    """ValueError naming the argument unless ``copy_path`` is one of
    :data:`COPY_PATHS` and ``staging_bytes`` is >= 1."""
    if copy_path not in COPY_PATHS:
        raise ValueError(f"copy_path must be one of {', '.join(COPY_PATHS)}, not {copy_path!r}")
    if not isinstance(staging_bytes, int) or staging_bytes < 1:
        raise ValueError(f"staging_bytes must be an int >= 1, not {staging_bytes!r}")


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _STAGING_ALIGN) * _STAGING_ALIGN


class StagingCopies:
    """The staging path of device ``index`` on its ``stream`` (module docstring).

    Called under the device's lock, with the device current: the device
    serialises its copies, so the one buffer is never shared by two.
    """

    def __init__(
        self, lib: TransferLibrary, index: int, staging_bytes: int, stream: int, max_ctas: int
    ) -> None:
        self._lib = lib
        self.index = index
        self.staging_bytes = staging_bytes
        self.stream = stream
        self.max_ctas = max_ctas
        self.fallbacks = 0  # calls that ran zero-copy: one chunk did not fit the buffer
        self.buffer = 0  # device address of the staging buffer; 0 until the first copy

    def batch_chunks(self, plan: CopyPlan, blocks_per_chunk: int) -> int:
        """Chunks per staged batch; 0 to copy zero-copy (a chunk too big, counted)."""
        nbytes = plan.chunk_nbytes(blocks_per_chunk)
        if nbytes > self.staging_bytes:
            if self.fallbacks == 0:
                logger.warning(
                    "device %d: a chunk of %d bytes exceeds ipc.staging_bytes (%d); "
                    "such copies run zero-copy",
                    self.index, nbytes, self.staging_bytes,
                )  # fmt: skip
            self.fallbacks += 1
            return 0
        # The last chunk of a batch need not be followed by alignment padding.
        return (self.staging_bytes - nbytes) // _aligned(nbytes) + 1

    def copy(
        self,
        kind: Literal["gather", "scatter"],
        batch: int,
        plan: CopyPlan,
        block_ids: Sequence[int],
        chunk_addresses: Sequence[int],
        blocks_per_chunk: int,
    ) -> None:
        """The copy through the staging buffer, ``batch`` chunks at a time; synchronised
        on return. Raises ValueError for block ids that do not fill the chunks,
        KernelError from the library."""
        per_chunk = blocks_per_chunk
        if len(block_ids) != len(chunk_addresses) * per_chunk:
            # Checked here, not only by the binding: batches slice both lists by it.
            raise ValueError(
                f"{len(block_ids)} block ids for {len(chunk_addresses)} chunks of "
                f"{per_chunk} blocks (expected {len(chunk_addresses) * per_chunk})"
            )
        nbytes = plan.chunk_nbytes(per_chunk)
        stride = _aligned(nbytes)
        staging = self._buffer()
        copy = self._lib.gather if kind == "gather" else self._lib.scatter
        try:
            for first in range(0, len(chunk_addresses), batch):
                arena = list(chunk_addresses[first : first + batch])
                ids = list(block_ids[first * per_chunk : (first + len(arena)) * per_chunk])
                staged = [staging + i * stride for i in range(len(arena))]
                for i, (stage, slot) in enumerate(zip(staged, arena, strict=True)):
                    # A skipped position (negative id) keeps the arena's bytes in a
                    # gather, as zero-copy does: fetch them so the copy back returns them.
                    skips = any(b < 0 for b in ids[i * per_chunk : (i + 1) * per_chunk])
                    if kind == "scatter" or skips:
                        self._lib.memcpy_async(stage, slot, nbytes, self.stream)
                copy(plan, ids, staged, per_chunk, stream=self.stream, max_ctas=self.max_ctas)
                if kind == "gather":
                    for stage, slot in zip(staged, arena, strict=True):
                        self._lib.memcpy_async(slot, stage, nbytes, self.stream)
        finally:
            # Also when a later batch is refused: nothing queued may outlive the call
            # (the caller frees the slots of a failed save).
            self._lib.synchronize(self.stream)

    def free(self) -> None:
        """Free the buffer, if one was allocated (the device's stream is idle)."""
        if self.buffer:
            buffer, self.buffer = self.buffer, 0
            self._lib.free(self.index, buffer)

    def _buffer(self) -> int:
        if not self.buffer:
            try:
                self.buffer = self._lib.malloc(self.index, self.staging_bytes)
            except KernelError as exc:
                raise CudaDeviceError.of_kernel(
                    f"allocating the {self.staging_bytes}-byte staging buffer on device "
                    f"{self.index} (ipc.staging_bytes)",
                    exc,
                ) from None
            logger.info(
                "device %d: %d-byte staging buffer allocated", self.index, self.staging_bytes
            )
        return self.buffer
