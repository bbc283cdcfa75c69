"""The L1 arena page-locked and mapped for the sidecar's GPUs, once for all of them.

Why a module of its own: registering tens of GiB with CUDA takes seconds
and is shared by every device of the process
(:class:`~kvstrata.sidecar.transfer.cuda_device.CudaDevices` makes one at
the first GPU), while each device only asks it for its own device address;
and the registration must outlive every device's copies and end before the
arena is unmapped. It speaks to CUDA through the csrc library only
(:mod:`kvstrata.sidecar.transfer.kernels`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvstrata.sidecar.transfer.ipc_device import CudaDeviceError
from kvstrata.sidecar.transfer.kernel_binding import KernelError, TransferLibrary

if TYPE_CHECKING:
    from kvstrata.sidecar.arena import Arena

__all__ = ["ArenaRegistration"]

logger = logging.getLogger("kvstrata.sidecar.transfer.cuda_device")


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
        self.device: int | None = None  # the first device mapped: current when unregistering
        try:
            _, self.owned = lib.host_register(self.host_address, self.size)
        except KernelError as exc:
            raise CudaDeviceError.of_kernel(
                f"registering the arena ({self.size} bytes) with CUDA", exc
            ) from None
        self._closed = False

    def device_address(self, device: int) -> int:
        """The address kernels of ``device`` use for the arena's first byte
        (makes ``device`` current for the calling thread)."""
        try:
            self._lib.set_device(device)
            address, registered = self._lib.host_register(self.host_address, self.size)
        except KernelError as exc:
            raise CudaDeviceError.of_kernel(f"mapping the arena for device {device}", exc) from None
        self.owned = self.owned or registered
        if self.device is None:
            self.device = device
        return address

    def close(self) -> None:
        """Unregister the arena if this object registered it; before the arena is unmapped."""
        if self._closed:
            return
        self._closed = True
        if self.owned:
            try:
                # A runtime call on a thread with no device chosen runs on device 0
                # and creates a context there (maybe another pod's GPU): choose ours.
                if self.device is not None:
                    self._lib.set_device(self.device)
                self._lib.host_unregister(self.host_address)
            except KernelError:
                logger.exception("unregistering the arena from CUDA failed")
