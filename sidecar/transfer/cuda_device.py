"""The sidecar's GPUs in ipc mode: CUDA IPC handles, events and the csrc kernels.

Why a module of its own: :class:`~kvstrata.sidecar.transfer.ipc.IpcTransfers`
knows sessions, plans and arena slots; this module knows CUDA. It speaks
to the GPU only through the csrc CUDA library
(:mod:`kvstrata.sidecar.transfer.kernels`), never through torch: the GPU
sidecar image need not carry torch, and the sidecar's copies must not
depend on a second CUDA runtime's idea of the current device.

What lives here, per sidecar process::

    CudaDevices (the factory open_cuda_devices returns; IpcTransfers caches its devices)
      ArenaRegistration   the L1 arena page-locked and mapped for every GPU, once
      CudaDevice per UUID device index, one non-blocking stream, the arena's device
                          address, the IPC allocations it has open (address -> opens)

Ordering contract of :class:`CudaDevice` (the ``TransferDevice`` protocol):
``gather`` makes the device's stream wait for the peer's interprocess event
(vLLM records it after the forward pass that wrote the blocks), launches the
kernel, and synchronises the stream; ``scatter`` launches and synchronises.
So a copy has finished when the call returns, before the sidecar commits a
slot or replies to LOAD_BLOCKS, and vLLM's next kernels (queued after that
reply) see the loaded blocks. Copies of one device are serialised by a lock,
and closing a handle takes the same lock, so no copy still reads memory that
is being unmapped.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvstrata.sidecar.transfer import kernels
from kvstrata.sidecar.transfer.kernels import KernelError, TransferLibrary

if TYPE_CHECKING:
    from kvstrata.sidecar.arena import Arena
    from kvstrata.sidecar.transfer.plan import CopyPlan

logger = logging.getLogger(__name__)


class CudaDeviceError(OSError):
    """A CUDA call of ipc mode failed; ``name`` is the cudaError_t's name when CUDA said one.

    An OSError, because that is how :class:`~kvstrata.sidecar.transfer.ipc.IpcTransfers`
    is told a GPU or a handle cannot be used (the client then gets an error reply).
    """

    def __init__(self, message: str, name: str = "") -> None:
        super().__init__(message)
        self.name = name


def _failed(what: str, exc: KernelError) -> CudaDeviceError:
    return CudaDeviceError(f"{what}: {exc}", exc.name)


class ArenaRegistration:
    """The arena page-locked and mapped for the GPUs, once for all of them.

    Registering tens of GiB takes seconds, so it is done once, when the
    sidecar starts, not at a worker's first REGISTER_KV (which has a
    deadline). The registration is portable (every device's context sees
    it); each device asks for its own device address. An arena that torch
    already pinned (``l1.pin_memory``) is used as it is and left to torch
    to unpin: :meth:`close` unregisters only what this object registered.
    """

    def __init__(self, lib: TransferLibrary, arena: Arena) -> None:
        self._lib = lib
        self.host_address = arena.address()
        self.size = arena.size
        try:
            _, self.owned = lib.host_register(self.host_address, self.size)
        except KernelError as exc:
            raise _failed(f"registering the arena ({self.size} bytes) with CUDA", exc) from None
        self._closed = False

    def device_address(self, device: int) -> int:
        """The address kernels of ``device`` use for the arena's first byte
        (makes ``device`` current for the calling thread)."""
        try:
            self._lib.set_device(device)
            address, registered = self._lib.host_register(self.host_address, self.size)
        except KernelError as exc:
            raise _failed(f"mapping the arena for device {device}", exc) from None
        self.owned = self.owned or registered
        return address

    def close(self) -> None:
        """Unregister the arena if this object registered it; before the arena is unmapped."""
        if self._closed:
            return
        self._closed = True
        if self.owned:
            try:
                self._lib.host_unregister(self.host_address)
            except KernelError:
                logger.exception("unregistering the arena from CUDA failed")


class CudaDevice:
    """One GPU, found by UUID, as ipc mode uses it (see the module docstring).

    ``registration``: the arena registration shared by all devices of the
    process (:class:`CudaDevices` passes it); without one, the device
    registers the arena itself and unregisters it in :meth:`close`.
    ``max_ctas`` caps the thread blocks of a copy (0: fill the GPU).

    Raises :class:`CudaDeviceError` when the UUID is malformed, no visible
    device has it, or the stream or the arena mapping cannot be made.
    """

    def __init__(
        self,
        lib: TransferLibrary,
        uuid: str,
        arena: Arena,
        registration: ArenaRegistration | None = None,
        max_ctas: int = 0,
    ) -> None:
        self.uuid = uuid
        self.max_ctas = max_ctas
        self._lib = lib
        self._lock = threading.Lock()
        self._opened: Counter[int] = Counter()  # IPC allocations: address -> opens
        self._closed = False
        try:
            self.index = lib.device_by_uuid(uuid)
        except ValueError as exc:
            raise CudaDeviceError(str(exc)) from None
        except KernelError as exc:
            raise _failed(f"GPU {uuid} is not visible to this process", exc) from None
        self._own_registration = registration is None
        if registration is None:
            try:
                lib.set_device(self.index)
            except KernelError as exc:
                raise _failed(f"GPU {uuid} (device {self.index})", exc) from None
            registration = ArenaRegistration(lib, arena)
        self.registration = registration
        self._arena_size = arena.size
        try:
            self._arena_base = registration.device_address(self.index)
            self.stream = lib.stream_create(self.index)
        except (CudaDeviceError, KernelError) as exc:
            if self._own_registration:
                registration.close()
            if isinstance(exc, KernelError):
                raise _failed(f"creating a stream on device {self.index}", exc) from None
            raise

    def __repr__(self) -> str:
        return f"CudaDevice({self.uuid!r}, index={self.index})"

    # -- TransferDevice -------------------------------------------------------

    def open_memory(self, handle: bytes) -> int:
        """Map a peer's allocation by its 64-byte ``cudaIpcMemHandle_t``; its device address.

        The same handle may be opened again (another session of the same
        worker): the same address comes back, and each open is closed once.
        """
        self._check_open()
        try:
            address = self._lib.ipc_open(self.index, handle)
        except KernelError as exc:
            raise _failed(f"opening a CUDA IPC handle on device {self.index}", exc) from None
        with self._lock:
            self._opened[address] += 1
        return address

    def close_memory(self, address: int) -> None:
        """Unmap one open of ``address``; waits for a copy that is running.

        Raises :class:`CudaDeviceError` when CUDA refuses and KeyError for
        an address this device did not open.
        """
        with self._lock:
            if self._opened[address] <= 0:
                raise KeyError(f"device {self.index} has no IPC allocation open at {address:#x}")
            self._opened[address] -= 1
            if self._opened[address] == 0:
                del self._opened[address]
            try:
                self._lib.ipc_close(self.index, address)
            except KernelError as exc:
                raise _failed(f"closing a CUDA IPC handle on device {self.index}", exc) from None

    def gather(
        self,
        plan: CopyPlan,
        block_ids: Sequence[int],
        chunk_addresses: Sequence[int],
        blocks_per_chunk: int,
        after_event: bytes | None,
    ) -> None:
        """Paged KV -> arena chunks, after the peer's event; done when it returns."""
        with self._lock:
            self._check_open()
            try:
                self._lib.set_device(self.index)
                if after_event is not None:
                    self._lib.stream_wait_ipc_event(self.index, self.stream, after_event)
                self._lib.gather(
                    plan, block_ids, chunk_addresses, blocks_per_chunk,
                    stream=self.stream, max_ctas=self.max_ctas,
                )  # fmt: skip
                self._lib.synchronize(self.stream)
            except KernelError as exc:
                raise _failed(f"gather on device {self.index}", exc) from None

    def scatter(
        self,
        plan: CopyPlan,
        block_ids: Sequence[int],
        chunk_addresses: Sequence[int],
        blocks_per_chunk: int,
    ) -> None:
        """Arena chunks -> paged KV; done when it returns."""
        with self._lock:
            self._check_open()
            try:
                self._lib.set_device(self.index)
                self._lib.scatter(
                    plan, block_ids, chunk_addresses, blocks_per_chunk,
                    stream=self.stream, max_ctas=self.max_ctas,
                )  # fmt: skip
                self._lib.synchronize(self.stream)
            except KernelError as exc:
                raise _failed(f"scatter on device {self.index}", exc) from None

    def arena_address(self, offset: int) -> int:
        """The address this device's kernels use for arena byte ``offset``."""
        if not 0 <= offset < self._arena_size:
            raise ValueError(f"arena offset {offset} is outside [0, {self._arena_size})")
        return self._arena_base + offset

    # -- life cycle -----------------------------------------------------------

    @property
    def open_handles(self) -> int:
        """IPC opens not yet closed (each open of one address counts)."""
        with self._lock:
            return sum(self._opened.values())

    def close(self) -> None:
        """Close what is still open, destroy the stream and, if this device registered
        the arena itself, unregister it. Idempotent; errors are logged, not raised."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            leftover = list(self._opened.elements())
            self._opened.clear()
            if leftover:
                logger.warning(
                    "device %d: closing %d IPC handles left open", self.index, len(leftover)
                )
            for address in leftover:
                self._quietly("cudaIpcCloseMemHandle", self._lib.ipc_close, self.index, address)
            self._quietly("cudaStreamSynchronize", self._lib.synchronize, self.stream)
            self._quietly("cudaStreamDestroy", self._lib.stream_destroy, self.index, self.stream)
        if self._own_registration:
            self.registration.close()

    def _quietly(self, what: str, fn: Callable[..., object], *args: int) -> None:
        try:
            fn(*args)
        except KernelError:
            logger.exception("device %d: %s failed while closing", self.index, what)

    def _check_open(self) -> None:
        if self._closed:
            raise CudaDeviceError(f"device {self.index} ({self.uuid}) is closed")


class CudaDevices:
    """The factory ``IpcTransfers`` opens GPUs with: ``devices(uuid) -> CudaDevice``.

    Every device shares one :class:`ArenaRegistration`. :meth:`close`
    closes every device opened through it, then unregisters the arena:
    call it before the arena is unmapped (before the engine closes).
    """

    def __init__(self, lib: TransferLibrary, arena: Arena, max_ctas: int = 0) -> None:
        self._lib = lib
        self._arena = arena
        self.max_ctas = max_ctas
        self.registration = ArenaRegistration(lib, arena)
        self._devices: list[CudaDevice] = []
        self._lock = threading.Lock()

    def __call__(self, uuid: str) -> CudaDevice:
        device = CudaDevice(self._lib, uuid, self._arena, self.registration, self.max_ctas)
        with self._lock:
            self._devices.append(device)
        logger.info("GPU %s is device %d here; arena mapped for it", uuid, device.index)
        return device

    def close(self) -> None:
        with self._lock:
            devices, self._devices = self._devices, []
        for device in devices:
            device.close()
        self.registration.close()


def open_cuda_devices(arena: Arena, max_ctas: int = 0) -> tuple[CudaDevices | None, str]:
    """The GPU factory for ipc mode, or None and why this sidecar cannot serve it.

    The reason names what is missing: the CUDA library (not built, disabled
    by ``KVSTRATA_CUDA_KERNELS=0``), a driver, a visible device, or the
    arena's registration. On success the arena is registered with CUDA
    before this returns, and the reason is "".
    """
    lib = kernels.load_cuda()
    if lib is None:
        return None, f"CUDA kernels unavailable: {kernels.cuda_unavailable_reason()}"
    try:
        return CudaDevices(lib, arena, max_ctas), ""
    except CudaDeviceError as exc:
        return None, str(exc)
