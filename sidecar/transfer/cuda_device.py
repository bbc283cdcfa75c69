"""The sidecar's GPUs in ipc mode: CUDA IPC handles, events and the csrc kernels.

Why a module of its own: :class:`~kvstrata.sidecar.transfer.ipc.IpcTransfers`
knows sessions, plans and arena slots; this module knows CUDA. It speaks
to the GPU only through the csrc CUDA library
(:mod:`kvstrata.sidecar.transfer.kernels`), never through torch: the GPU
sidecar image need not carry torch, and the sidecar's copies must not
depend on a second CUDA runtime's idea of the current device.

What a sidecar process holds in ipc mode::

    CudaDevices (the factory open_cuda_devices returns; IpcTransfers caches its devices)
      ArenaRegistration   the L1 arena page-locked and mapped for every GPU, once
      CudaDevice per UUID device index, one non-blocking stream, the arena's device
                          address, the IPC allocations it has open (address -> opens),
                          its copy path and, for "staging", its StagingCopies (.staging)

Ordering contract of :class:`CudaDevice` (the ``TransferDevice`` protocol):
``gather`` and ``scatter`` wait on the host, boundedly, for the peer's
interprocess event (vLLM records it after the forward pass that wrote the
blocks, or after the step a load must follow), launch the kernel and
synchronise the stream.
So a copy has finished when the call returns, before the sidecar commits a
slot or replies to LOAD_BLOCKS, and vLLM's next kernels (queued after that
reply) see the loaded blocks. Copies of one device are serialised by a lock,
and closing a handle takes the same lock, so no copy still reads memory that
is being unmapped.

Two copy paths, chosen per sidecar (``ipc.copy_path``): ``zero_copy``,
where the kernel reads and writes the pinned arena itself over PCIe, and
``staging``, through a buffer in device memory
(:mod:`kvstrata.sidecar.transfer.staging`). The peer's event is waited
for on the host (:mod:`kvstrata.sidecar.transfer.peer_events`); the
arena's registration with CUDA is
:mod:`kvstrata.sidecar.transfer.arena_registration`'s.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvstrata.sidecar.transfer import kernels
from kvstrata.sidecar.transfer.arena_registration import ArenaRegistration
from kvstrata.sidecar.transfer.ipc_device import CudaDeviceError
from kvstrata.sidecar.transfer.kernel_binding import KernelError, TransferLibrary
from kvstrata.sidecar.transfer.peer_events import DEFAULT_PEER_EVENT_TIMEOUT_S, wait_for_peer_event
from kvstrata.sidecar.transfer.staging import (
    DEFAULT_STAGING_BYTES,
    CopyPath,
    StagingCopies,
    check_copy_path,
)

if TYPE_CHECKING:
    from kvstrata.sidecar.arena import Arena
    from kvstrata.sidecar.transfer.plan import CopyPlan

logger = logging.getLogger(__name__)

__all__ = ["CudaDevice", "CudaDevices", "open_cuda_devices"]


def _failed(what: str, exc: KernelError) -> CudaDeviceError:
    return CudaDeviceError.of_kernel(what, exc)


class CudaDevice:
    """One GPU, found by UUID, as ipc mode uses it (see the module docstring).

    ``registration``: the arena registration shared by all devices of the
    process (:class:`CudaDevices` passes it); without one, the device
    registers the arena itself and unregisters it in :meth:`close`.
    ``max_ctas`` caps the thread blocks of a copy (0: fill the GPU).
    ``copy_path`` and ``staging_bytes``: how copies reach the arena (see
    the module docstring); ``fallbacks`` counts the staging calls that ran
    zero-copy because one chunk did not fit the buffer.

    Raises ValueError for a copy path or staging size :func:`check_copy_path`
    refuses, and :class:`CudaDeviceError` when the UUID is malformed, no
    visible device has it, or the stream or the arena mapping cannot be made.
    """

    def __init__(
        self,
        lib: TransferLibrary,
        uuid: str,
        arena: Arena,
        registration: ArenaRegistration | None = None,
        max_ctas: int = 0,
        copy_path: CopyPath = "zero_copy",
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        peer_event_timeout_s: float = DEFAULT_PEER_EVENT_TIMEOUT_S,
    ) -> None:
        check_copy_path(copy_path, staging_bytes)
        self.uuid = uuid
        self.peer_event_timeout_s = peer_event_timeout_s
        self.max_ctas = max_ctas
        self.copy_path = copy_path
        self.staging_bytes = staging_bytes
        self._staging: StagingCopies | None = None  # the staging path, once the stream is made
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
        if copy_path == "staging":
            self._staging = StagingCopies(lib, self.index, staging_bytes, self.stream, max_ctas)

    def __repr__(self) -> str:
        return f"CudaDevice({self.uuid!r}, index={self.index}, copy_path={self.copy_path!r})"

    @property
    def fallbacks(self) -> int:
        """Staging calls that ran zero-copy: one chunk did not fit the buffer."""
        return self._staging.fallbacks if self._staging is not None else 0

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

    def mapped_nbytes(self, address: int) -> int | None:
        """Bytes of the allocation from ``address`` on, as the driver knows it;
        None when this driver cannot say (the worker's size is then the bound)."""
        self._check_open()
        try:
            base, size = self._lib.mem_range(self.index, address)
        except KernelError as exc:
            logger.warning("device %d: allocation size unknown: %s", self.index, exc)
            return None
        return base + size - address if base <= address < base + size else 0

    def gather(
        self,
        plan: CopyPlan,
        block_ids: Sequence[int],
        chunk_addresses: Sequence[int],
        blocks_per_chunk: int,
        after_event: bytes | None,
        cancelled: Callable[[], bool] | None = None,
    ) -> None:
        """Paged KV -> arena chunks, after the peer's event; done when it returns.

        The event is waited for on the host, without the device lock, until
        it completes, ``cancelled()`` says the session ended, or
        ``peer_event_timeout_s`` passes (see :meth:`_wait_for_peer`).

        Raises ValueError for inputs the kernels' binding refuses and
        :class:`CudaDeviceError` naming the CUDA error of a failed step, or
        the peer's event that did not complete.
        """
        if after_event is not None:
            self._wait_for_peer(after_event, cancelled)
        with self._lock:
            self._check_open()
            try:
                self._lib.set_device(self.index)
                staging = self._staging
                batch = staging.batch_chunks(plan, blocks_per_chunk) if staging else 0
                if staging is not None and batch:
                    staging.copy(
                        "gather", batch, plan, block_ids, chunk_addresses, blocks_per_chunk
                    )
                else:
                    self._lib.gather(
                        plan, block_ids, chunk_addresses, blocks_per_chunk,
                        stream=self.stream, max_ctas=self.max_ctas,
                    )  # fmt: skip
                    self._lib.synchronize(self.stream)
            except KernelError as exc:
                raise _failed(f"gather on device {self.index}", exc) from None

    def _wait_for_peer(self, event: bytes, cancelled: Callable[[], bool] | None) -> None:
        """Return once the peer's interprocess event has completed (on the host, bounded:
        :mod:`kvstrata.sidecar.transfer.peer_events` says why)."""
        wait_for_peer_event(self._lib, self.index, event, cancelled, self.peer_event_timeout_s)

    def scatter(
        self,
        plan: CopyPlan,
        block_ids: Sequence[int],
        chunk_addresses: Sequence[int],
        blocks_per_chunk: int,
        after_event: bytes | None = None,
        cancelled: Callable[[], bool] | None = None,
    ) -> None:
        """Arena chunks -> paged KV, after the peer's event (vLLM's queued work,
        which may still use these blocks); done when it returns (errors as
        :meth:`gather`).

        The event is waited for as in :meth:`gather`, on the host and without
        the device lock: a device-side wait on the event of a vLLM killed
        mid-step may never end, and the stream sync after it would hold every
        session's copies and the dead worker's mapping with it.
        """
        if after_event is not None:
            self._wait_for_peer(after_event, cancelled)
        with self._lock:
            self._check_open()
            # The lock may have been waited for: a client past its deadline has
            # handed these blocks to other work, so nothing is written to them.
            if cancelled is not None and cancelled():
                raise CudaDeviceError("the load was cancelled before its copy started")
            try:
                self._lib.set_device(self.index)
                staging = self._staging
                batch = staging.batch_chunks(plan, blocks_per_chunk) if staging else 0
                if staging is not None and batch:
                    staging.copy(
                        "scatter", batch, plan, block_ids, chunk_addresses, blocks_per_chunk
                    )
                else:
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
        """Close what is still open, free the staging buffer, destroy the stream and,
        if this device registered the arena itself, unregister it. Idempotent; errors
        are logged, not raised."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            # Closing may run on any thread (shutdown, a test): one that never chose a
            # device would create a context on device 0 at its first runtime call.
            self._quietly("cudaSetDevice", self._lib.set_device, self.index)
            leftover = list(self._opened.elements())
            self._opened.clear()
            if leftover:
                logger.warning(
                    "device %d: closing %d IPC handles left open", self.index, len(leftover)
                )
            for address in leftover:
                self._quietly("cudaIpcCloseMemHandle", self._lib.ipc_close, self.index, address)
            self._quietly("cudaStreamSynchronize", self._lib.synchronize, self.stream)
            if self._staging is not None:
                self._quietly("cudaFree", self._staging.free)
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

    Every device shares one :class:`ArenaRegistration`, made when the first
    device is opened, with that device current. Why not at start: whatever
    first touches the CUDA runtime creates a context on the current device,
    device 0 unless set, and a sidecar that sees every GPU of the node
    (``NVIDIA_VISIBLE_DEVICES=all``) would spend ~0.5 GiB on a GPU that is
    not its vLLM's, or fail where that GPU is in EXCLUSIVE_PROCESS mode.
    The first REGISTER_KV names the GPU (by UUID); the device is made
    current before anything else runs on it. :meth:`close`
    closes every device opened through it, then unregisters the arena:
    call it before the arena is unmapped (before the engine closes).
    ``copy_path`` / ``staging_bytes`` apply to every device (ValueError, before
    anything is registered, for values :func:`check_copy_path` refuses).
    """

    def __init__(
        self,
        lib: TransferLibrary,
        arena: Arena,
        max_ctas: int = 0,
        copy_path: CopyPath = "zero_copy",
        staging_bytes: int = DEFAULT_STAGING_BYTES,
    ) -> None:
        check_copy_path(copy_path, staging_bytes)
        self._lib = lib
        self._arena = arena
        self.max_ctas = max_ctas
        self.copy_path = copy_path
        self.staging_bytes = staging_bytes
        self.registration: ArenaRegistration | None = None  # at the first device
        self._devices: list[CudaDevice] = []
        self._lock = threading.Lock()

    def __call__(self, uuid: str) -> CudaDevice:
        with self._lock:
            if self.registration is None:
                self.registration = self._register_on(uuid)
            device = CudaDevice(
                self._lib, uuid, self._arena, self.registration, self.max_ctas,
                self.copy_path, self.staging_bytes,
            )  # fmt: skip
            self._devices.append(device)
        logger.info(
            "GPU %s is device %d here; arena mapped for it; copy path %s",
            uuid, device.index, self.copy_path,
        )  # fmt: skip
        return device

    def _register_on(self, uuid: str) -> ArenaRegistration:
        """The arena registration, made with GPU ``uuid`` current (see the class)."""
        try:
            index = self._lib.device_by_uuid(uuid)
        except ValueError as exc:
            raise CudaDeviceError(str(exc)) from None
        except KernelError as exc:
            raise _failed(f"GPU {uuid} is not visible to this process", exc) from None
        try:
            self._lib.set_device(index)
        except KernelError as exc:
            raise _failed(f"GPU {uuid} (device {index})", exc) from None
        return ArenaRegistration(self._lib, self._arena)

    def close(self) -> None:
        with self._lock:
            devices, self._devices = self._devices, []
            registration, self.registration = self.registration, None
        for device in devices:
            device.close()
        if registration is not None:
            registration.close()


def open_cuda_devices(
    arena: Arena,
    max_ctas: int = 0,
    copy_path: CopyPath = "zero_copy",
    staging_bytes: int = DEFAULT_STAGING_BYTES,
) -> tuple[CudaDevices | None, str]:
    """The GPU factory for ipc mode, or None and why this sidecar cannot serve it.

    The reason names what is missing: the CUDA library (not built, disabled
    by ``KVSTRATA_CUDA_KERNELS=0``), a driver, a visible device, or the
    arena's registration. On success the reason is ""; the arena is
    registered with CUDA when the first GPU is opened (see
    :class:`CudaDevices`). Every device copies by
    ``copy_path`` (``staging``: through ``staging_bytes`` of device memory
    each); ValueError for values :func:`check_copy_path` refuses.
    """
    check_copy_path(copy_path, staging_bytes)
    lib = kernels.load_cuda()
    if lib is None:
        return None, f"CUDA kernels unavailable: {kernels.cuda_unavailable_reason()}"
    try:
        return CudaDevices(lib, arena, max_ctas, copy_path, staging_bytes), ""
    except CudaDeviceError as exc:
        return None, str(exc)
