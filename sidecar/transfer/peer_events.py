"""Waiting on the host for a peer's interprocess CUDA event before a copy touches its blocks.

Why on the host and not ``cudaStreamWaitEvent`` plus a stream sync: a vLLM
killed between recording the event and its forward pass finishing leaves a
device-side wait that may never end, and a sync on it would hold the
device's lock (every session's copies) and the dead worker's mapping
forever (``IpcTransfers.close`` waits for running copies). Polling the
event keeps vLLM's side free of any host sync (its forward pass stays
asynchronous) and bounds the wait: by the session's end (its process
gone) and by a deadline.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvstrata.sidecar.transfer.ipc_device import CudaDeviceError
from kvstrata.sidecar.transfer.kernel_binding import KernelError, TransferLibrary

__all__ = ["DEFAULT_PEER_EVENT_TIMEOUT_S", "wait_for_peer_event"]

# Polling a peer's event: first after 20 us (a forward pass usually ends soon
# after vLLM asks to save), backing off to 1 ms; the default bound is far above
# any forward pass.
_POLL_FIRST_S = 20e-6
_POLL_MAX_S = 1e-3
DEFAULT_PEER_EVENT_TIMEOUT_S = 60.0


def wait_for_peer_event(
    lib: TransferLibrary,
    device: int,
    event: bytes,
    cancelled: Callable[[], bool] | None,
    timeout_s: float = DEFAULT_PEER_EVENT_TIMEOUT_S,
) -> None:
    """Return once the peer's interprocess ``event`` has completed on ``device``.

    Raises :class:`CudaDeviceError` when the event cannot be queried, when
    ``cancelled()`` says the session ended, or after ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    pause = _POLL_FIRST_S
    while True:
        try:
            if lib.ipc_event_done(device, event):
                return
        except KernelError as exc:
            # The peer's event, not this context: no error name, so it is
            # never taken for a fault of the sidecar's GPU context.
            raise CudaDeviceError(f"querying the peer's event on device {device}: {exc}") from None
        if cancelled is not None and cancelled():
            raise CudaDeviceError("the session ended while its copy waited for vLLM's event")
        if time.monotonic() >= deadline:
            raise CudaDeviceError(
                f"vLLM's event did not complete within {timeout_s} s "
                "(its process may have died); the copy is dropped"
            )
        time.sleep(pause)
        pause = min(pause * 2, _POLL_MAX_S)
