"""What ipc mode asks of a GPU, how it fails, and which of its errors break it for good.

Why a module of its own: :mod:`.ipc` (sessions, plans, arena slots) drives
a device through this interface only, so the CUDA device
(:class:`~kvstrata.sidecar.transfer.cuda_device.CudaDevice`) and the tests'
host-memory stand-in (:mod:`kvstrata.testing.shmdevice`) are interchangeable;
a GPU step that fails raises :class:`CudaDeviceError`; and a failed copy is
judged here: a sticky CUDA error retires ipc mode for
the process (the handlers move its sessions to host mode), any other costs
that copy only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from kvstrata.sidecar.transfer.kernel_binding import KernelError
    from kvstrata.sidecar.transfer.plan import CopyPlan

__all__ = ["STICKY_CUDA_ERRORS", "CudaDeviceError", "TransferDevice"]


class TransferDevice(Protocol):
    """One GPU as the sidecar uses it in ipc mode. Every call is synchronous:
    a copy has finished (or failed, raising) when it returns."""

    def open_memory(self, handle: bytes) -> int:
        """Map a peer's allocation; its device address. Raises OSError."""
        ...

    def close_memory(self, address: int) -> None: ...

    def mapped_nbytes(self, address: int) -> int | None:
        """How many bytes the allocation opened at ``address`` has; None when
        the device cannot tell (the worker's ``mapped_nbytes`` is then the bound)."""
        ...

    def gather(
        self,
        plan: CopyPlan,
        block_ids: Sequence[int],
        chunk_addresses: Sequence[int],
        blocks_per_chunk: int,
        after_event: bytes | None,
        cancelled: Callable[[], bool] | None = None,
    ) -> None:
        """Paged KV -> chunks in the arena, after the peer's event (if any);
        gives up (raising) once ``cancelled()`` is true: the session ended."""
        ...

    def scatter(
        self,
        plan: CopyPlan,
        block_ids: Sequence[int],
        chunk_addresses: Sequence[int],
        blocks_per_chunk: int,
        after_event: bytes | None = None,
        cancelled: Callable[[], bool] | None = None,
    ) -> None:
        """Chunks in the arena -> paged KV, after the peer's event (if any);
        gives up (raising) once ``cancelled()`` is true, as :meth:`gather`."""
        ...

    def arena_address(self, offset: int) -> int:
        """The device-visible address of arena byte ``offset``."""
        ...


# cudaError_t names after which the CUDA context is unusable: every later call
# of the process fails too (CUDA Runtime API, "sticky" errors).
STICKY_CUDA_ERRORS = frozenset(
    {
        "cudaErrorIllegalAddress",
        "cudaErrorLaunchFailure",
        "cudaErrorHardwareStackError",
        "cudaErrorIllegalInstruction",
        "cudaErrorMisalignedAddress",
        "cudaErrorInvalidAddressSpace",
        "cudaErrorInvalidPc",
        "cudaErrorAssert",
        "cudaErrorECCUncorrectable",
        "cudaErrorUnknown",
    }
)


class CudaDeviceError(OSError):
    """A CUDA call of ipc mode failed; ``name`` is the cudaError_t's name when CUDA said one.

    An OSError, because that is how :class:`~kvstrata.sidecar.transfer.ipc.IpcTransfers`
    is told a GPU or a handle cannot be used (the client then gets an error
    reply); ``name`` is what :data:`STICKY_CUDA_ERRORS` is checked against.
    """

    def __init__(self, message: str, name: str = "") -> None:
        super().__init__(message)
        self.name = name

    @classmethod
    def of_kernel(cls, what: str, exc: KernelError) -> CudaDeviceError:
        """The error of step ``what`` that failed with the csrc library's ``exc``."""
        return cls(f"{what}: {exc}", exc.name)
