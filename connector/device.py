"""Where the worker's copies run: inline on the CPU, or on a CUDA stream of its own.

Why a module: the copy code (:mod:`kvstrata.sidecar.transfer.torch_copy`)
is the same on every device; what differs is ordering. On vLLM-CPU a copy
is done when it returns. On CUDA, copies between the pinned arena and
vLLM's KV run on the connector's own stream, so they overlap vLLM's
compute, and are ordered against it with events:

* loads: the stream first waits for what vLLM queued before
  ``start_load_kv``; after the step's copies one event is recorded and
  vLLM's current stream waits for it before ``start_load_kv`` returns, so
  nothing vLLM queues afterwards -- an eager layer, a piecewise graph or
  a replayed FULL graph, in which no Python hook runs -- can read a block
  before its load finished. That ordering does not depend on which graph
  mode vLLM picks, nor on whether it calls us inside a forward context
  (vLLM 0.32's V2 model runner calls ``pre_forward`` outside one for
  FULL graphs); what it gives up is overlapping one layer's compute with
  the next layer's copies of an L1 hit. Leases of the loaded slots are
  released once the copies have finished (:meth:`DeviceCopies.loads_done`),
  never before: the sidecar may reuse a released slot.
* saves: the stream waits for vLLM's forward pass, copies, and is
  synchronised before the slots are committed (a committed slot must
  hold its bytes).

The shared arena is registered with CUDA as page-locked memory
(``cudaHostRegister``) so copies to and from it are DMA, not staged through
a bounce buffer; it is unregistered before its mapping can go away. The
registration runs on a thread of its own: page-locking tens of GiB takes
seconds, and the first ``arena()`` call (and the first after a sidecar
restart) comes inside a vLLM step. Until it is done, copies work as from
pageable memory (the driver stages them): correct, only slower.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator

import torch

logger = logging.getLogger(__name__)

# cudaHostRegisterPortable | cudaHostRegisterMapped: pinned for every CUDA
# context of the process, and addressable by kernels (zero-copy).
_HOST_REGISTER_FLAGS = 1 | 2


class DeviceCopies:
    """Inline copies (CPU tensors). See the module docstring."""

    asynchronous = False

    def register_arena(self, arena: torch.Tensor) -> None:
        """Make ``arena`` (uint8, CPU) a DMA target; no-op on the CPU."""

    def unregister_arena(self) -> None:
        """Undo :meth:`register_arena` before the mapping may be dropped."""

    @contextlib.contextmanager
    def loading(self) -> Iterator[None]:
        """Copies inside finish before anything vLLM queues after the block."""
        yield

    def loads_done(self) -> None:
        """Return once every queued load copy has finished (blocks on CUDA)."""

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """Copies inside run after vLLM's forward pass and are done on exit."""
        yield

    def close(self) -> None:
        self.unregister_arena()


class CudaCopies(DeviceCopies):
    """Copies on the connector's own CUDA stream, ordered with events."""

    asynchronous = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self._loaded = torch.cuda.Event()  # recorded after a step's load copies
        self._loads_queued = False
        self._registered: int | None = None  # data_ptr of the registered arena
        self._pinning: threading.Thread | None = None  # registering it now

    def register_arena(self, arena: torch.Tensor) -> None:
        """Page-lock ``arena`` on a thread of its own (see the module docstring);
        returns at once."""
        self.unregister_arena()
        self._pinning = threading.Thread(
            target=self._pin, args=(arena.data_ptr(), arena.numel()),
            name="kvstrata-pin-arena", daemon=True,
        )  # fmt: skip
        self._pinning.start()

    def _pin(self, address: int, nbytes: int) -> None:
        # This thread's current device first: without it the registration would
        # create a context on device 0, another rank's GPU.
        torch.cuda.set_device(self.device)
        err = torch.cuda.cudart().cudaHostRegister(address, nbytes, _HOST_REGISTER_FLAGS)
        if int(err) != 0:
            # Copies still work (staged by the driver), only slower.
            logger.warning("kvstrata: cudaHostRegister of the arena failed (%s)", err)
            return
        self._registered = address

    def unregister_arena(self) -> None:
        pinning, self._pinning = self._pinning, None
        if pinning is not None:
            pinning.join()  # a registration in flight ends before the mapping may go
        if self._registered is not None:
            # Nothing may still copy from it: only our stream does (loads and
            # saves alike). A device-wide synchronize would also wait for
            # vLLM's queued compute, inside the step that re-maps the arena.
            self.stream.synchronize()
            torch.cuda.cudart().cudaHostUnregister(self._registered)
            self._registered = None

    @contextlib.contextmanager
    def loading(self) -> Iterator[None]:
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)
        try:
            with torch.cuda.stream(self.stream):
                yield
        finally:
            # Even when a copy failed part-way, what was queued is waited for:
            # vLLM may recompute those blocks, and its writes must come after.
            self._loaded.record(self.stream)
            compute.wait_event(self._loaded)
            self._loads_queued = True

    def loads_done(self) -> None:
        if self._loads_queued:
            self._loaded.synchronize()
            self._loads_queued = False

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            yield
        self.stream.synchronize()


def copies_for(device: torch.device) -> DeviceCopies:
    """The copy ordering for KV tensors on ``device``."""
    if device.type == "cuda":
        return CudaCopies(device)
    return DeviceCopies()
