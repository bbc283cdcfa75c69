"""The ctypes binding of one loaded ``csrc/`` library: its copies and ipc mode's CUDA runtime calls.

Why a module of its own: :class:`TransferLibrary` is the one Python face of
the C ABI (``csrc/kvs_abi.h``; declarations and argument checks in
:mod:`kvstrata.sidecar.transfer.abi`), whichever library is behind it;
where that library comes from is :mod:`kvstrata.sidecar.transfer.kernels`'s
business. Every backend gathers and scatters by a :class:`CopyPlan`; the
``cuda`` backend also carries the runtime calls the sidecar's ipc mode
needs without torch (device by UUID, CUDA IPC memory and event handles,
streams, host registration, free memory, device buffers and async copies
for the staging copy path), used by
:mod:`kvstrata.sidecar.transfer.cuda_device`. A failed CUDA call raises
:class:`KernelError` naming the ``cudaError_t``.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kvstrata.sidecar.transfer import abi
from kvstrata.sidecar.transfer.abi import IntArray

if TYPE_CHECKING:
    from kvstrata.sidecar.transfer.plan import CopyPlan

__all__ = ["KernelError", "TransferLibrary"]


class KernelError(RuntimeError):
    """A CUDA call of the library failed; ``code`` is the cudaError_t, ``name`` its name."""

    def __init__(self, what: str, code: int, name: str, text: str) -> None:
        super().__init__(f"{what} failed: {name} ({text}, CUDA error {code})")
        self.code = code
        self.name = name


class TransferLibrary:
    """One loaded csrc library (``backend`` "cuda" or "host") behind the C ABI.

    Thread-safe: calls hold no Python state and release the GIL while they copy.
    """

    def __init__(self, path: Path, cdll: ctypes.CDLL) -> None:
        self.path = path
        self._lib = cdll
        self.backend: str = cdll.kvs_backend().decode()
        self.source_hash: str = cdll.kvs_source_hash().decode()

    def gather(
        self,
        plan: CopyPlan,
        block_ids: IntArray,
        chunk_addresses: IntArray,
        blocks_per_chunk: int,
        stream: Any = 0,
        max_ctas: int = 0,
    ) -> None:
        """Copy paged blocks into chunk buffers (pages -> chunks).

        For chunk ``c`` and position ``p``, block ``block_ids[c * P + p]`` of
        every layer lands at ``chunk_addresses[c]`` in the plan's chunk order;
        a negative id leaves that position's bytes of the chunk untouched.
        Each chunk buffer holds ``plan.chunk_nbytes(blocks_per_chunk)`` bytes
        and overlaps no page (neither can be checked from raw addresses).
        CUDA: runs on ``stream`` (an integer ``cudaStream_t``, or an object
        with ``.cuda_stream`` such as a ``torch.cuda.Stream``; 0 is the legacy
        default stream) on the current device and returns once launched: the
        buffers must live until the stream passes it. ``max_ctas`` caps the
        thread blocks (0: fill the GPU) to leave SMs to a concurrent model.
        Host: the addresses are host memory and the copy is done on return.
        Raises ValueError for bad input (checked before anything runs) and
        :class:`KernelError` when the launch fails.
        """
        self._copy(
            "kvs_gather", plan, block_ids, chunk_addresses, blocks_per_chunk, stream, max_ctas
        )

    def scatter(
        self,
        plan: CopyPlan,
        block_ids: IntArray,
        chunk_addresses: IntArray,
        blocks_per_chunk: int,
        stream: Any = 0,
        max_ctas: int = 0,
    ) -> None:
        """Copy chunk buffers into paged blocks (chunks -> pages); see :meth:`gather`.

        A negative id skips its position: those blocks are not written (a load
        skips the leading blocks vLLM's prefix cache already holds).
        """
        self._copy(
            "kvs_scatter", plan, block_ids, chunk_addresses, blocks_per_chunk, stream, max_ctas
        )

    def vector_width(self, plan: CopyPlan, chunk_addresses: IntArray) -> int:
        """The access width in bytes (16, 8, 4, 2 or 1) a copy of these inputs uses."""
        layers = abi.plan_layers(plan)
        chunks = abi.int_array(chunk_addresses, "chunk_addresses", np.uint64, 1, abi.U64_MAX)
        return int(
            self._lib.kvs_vector_width(
                layers.ctypes.data, len(layers), plan.block_stride, plan.segment_stride,
                plan.segment_bytes, chunks.ctypes.data, len(chunks),
            )
        )  # fmt: skip

    def synchronize(self, stream: Any = 0) -> None:
        """Wait until ``stream`` has run everything queued (CUDA); no-op on the host.

        Raises :class:`KernelError` naming an error a kernel hit on the way.
        """
        if self.backend == "cuda":
            self._check(
                "cudaStreamSynchronize",
                self._lib.kvs_cuda_stream_synchronize(abi.stream_handle(stream)),
            )

    def _copy(
        self,
        fn: str,
        plan: CopyPlan,
        block_ids: IntArray,
        chunk_addresses: IntArray,
        blocks_per_chunk: int,
        stream: Any,
        max_ctas: int,
    ) -> None:
        layers = abi.plan_layers(plan)
        chunks = abi.int_array(chunk_addresses, "chunk_addresses", np.uint64, 1, abi.U64_MAX)
        if not 1 <= blocks_per_chunk <= abi.I32_MAX:
            raise ValueError(f"blocks_per_chunk must be >= 1, not {blocks_per_chunk}")
        ids = abi.int_array(block_ids, "block_ids", np.int64, -(2**63), plan.num_blocks - 1)
        if len(ids) != len(chunks) * blocks_per_chunk:
            raise ValueError(
                f"{len(ids)} block ids for {len(chunks)} chunks of {blocks_per_chunk} blocks "
                f"(expected {len(chunks) * blocks_per_chunk})"
            )
        if not 0 <= max_ctas <= abi.I32_MAX:
            raise ValueError(f"max_ctas must be >= 0, not {max_ctas}")
        handle = abi.stream_handle(stream)
        if len(chunks) == 0:
            return
        code = getattr(self._lib, fn)(
            layers.ctypes.data, len(layers), plan.block_stride, plan.num_segments,
            plan.segment_stride, plan.segment_bytes, int(plan.block_outer), ids.ctypes.data,
            blocks_per_chunk, chunks.ctypes.data, len(chunks), max_ctas, handle,
        )  # fmt: skip
        self._check(fn, code)

    # -- both backends --------------------------------------------------------

    def parse_uuid(self, text: str) -> bytes:
        """The 16 bytes of a GPU UUID written as nvidia-smi, a MIG instance or torch
        writes it (``GPU-``/``MIG-`` prefix optional, dashes optional, any case);
        ValueError when ``text`` is not one. The rule :meth:`device_by_uuid` matches by.
        """
        out = ctypes.create_string_buffer(16)
        if self._lib.kvs_uuid_parse(abi.ascii_arg(text, "uuid"), out) != 0:
            raise ValueError(f"{text!r} is not a GPU UUID (like GPU-<8-4-4-4-12 hex digits>)")
        return out.raw

    # -- CUDA library only: the runtime calls of ipc mode ---------------------

    def device_by_uuid(self, uuid: str) -> int:
        """The index (as this process numbers devices) of the GPU whose UUID is ``uuid``.

        Raises ValueError for malformed text and :class:`KernelError` named
        ``cudaErrorInvalidDevice`` when no visible device has it.
        """
        self.parse_uuid(uuid)
        device = ctypes.c_int32(-1)
        self._cuda_call(
            "kvs_cuda_device_by_uuid", abi.ascii_arg(uuid, "uuid"), ctypes.byref(device)
        )
        return device.value

    def set_device(self, device: int) -> None:
        """Make ``device`` the calling thread's current device (the one
        :meth:`gather` / :meth:`scatter` launch on)."""
        self._cuda_call("kvs_cuda_set_device", abi.device_index(device))

    def ipc_open(self, device: int, handle: bytes) -> int:
        """Map another process's allocation (its 64-byte ``cudaIpcMemHandle_t``) on
        ``device``; the device address of its first byte. Close it with :meth:`ipc_close`.
        """
        address = ctypes.c_uint64(0)
        self._cuda_call(
            "kvs_cuda_ipc_open", abi.device_index(device), abi.ipc_handle_arg(handle, "handle"),
            ctypes.byref(address),
        )  # fmt: skip
        return address.value

    def ipc_close(self, device: int, address: int) -> None:
        """Unmap an allocation :meth:`ipc_open` mapped (once per open)."""
        self._cuda_call(
            "kvs_cuda_ipc_close", abi.device_index(device), abi.address_arg(address, "address")
        )

    def mem_range(self, device: int, address: int) -> tuple[int, int]:
        """``(base, size)`` of the allocation ``address`` lies in (cuMemGetAddressRange)."""
        base, size = ctypes.c_uint64(0), ctypes.c_uint64(0)
        self._cuda_call(
            "kvs_cuda_mem_range", abi.device_index(device), abi.address_arg(address, "address"),
            ctypes.byref(base), ctypes.byref(size),
        )  # fmt: skip
        return base.value, size.value

    def stream_create(self, device: int) -> int:
        """A new non-blocking stream of ``device`` (a ``cudaStream_t`` as an integer)."""
        stream = ctypes.c_uint64(0)
        self._cuda_call("kvs_cuda_stream_create", abi.device_index(device), ctypes.byref(stream))
        return stream.value

    def stream_destroy(self, device: int, stream: int) -> None:
        """Destroy a stream :meth:`stream_create` made (queued work still completes)."""
        self._cuda_call(
            "kvs_cuda_stream_destroy", abi.device_index(device), abi.address_arg(stream, "stream")
        )

    def stream_wait_ipc_event(self, device: int, stream: int, event_handle: bytes) -> None:
        """Queue on ``stream`` a wait for another process's interprocess event (its
        64-byte ``cudaIpcEventHandle_t``): later work on the stream runs after the
        event's last record completes. The host does not block."""
        self._cuda_call(
            "kvs_cuda_stream_wait_ipc_event",
            abi.device_index(device),
            abi.address_arg(stream, "stream"),
            abi.ipc_handle_arg(event_handle, "event_handle"),
        )

    def ipc_event_done(self, device: int, event_handle: bytes) -> bool:
        """Whether another process's interprocess event (its 64-byte
        ``cudaIpcEventHandle_t``) has completed its last record; never blocks."""
        done = ctypes.c_int32(0)
        self._cuda_call(
            "kvs_cuda_ipc_event_query", abi.device_index(device),
            abi.ipc_handle_arg(event_handle, "event_handle"), ctypes.byref(done),
        )  # fmt: skip
        return bool(done.value)

    def host_register(self, address: int, nbytes: int) -> tuple[int, bool]:
        """Page-lock and map ``nbytes`` of host memory at ``address`` for the GPUs, on
        the current device: ``(device address, registered here)``.

        Memory already registered (torch pinned it) is left so, and only its device
        address is returned with ``False``: unregister only what this call registered.
        """
        if not 1 <= nbytes <= abi.U64_MAX:
            raise ValueError(f"nbytes must be >= 1, not {nbytes}")
        device_address = ctypes.c_uint64(0)
        registered = ctypes.c_int32(0)
        self._cuda_call(
            "kvs_cuda_host_register", abi.address_arg(address, "address"), nbytes,
            ctypes.byref(device_address), ctypes.byref(registered),
        )  # fmt: skip
        return device_address.value, bool(registered.value)

    def host_unregister(self, address: int) -> None:
        """Undo :meth:`host_register` (before the memory is unmapped)."""
        self._cuda_call("kvs_cuda_host_unregister", abi.address_arg(address, "address"))

    def mem_get_info(self, device: int) -> tuple[int, int]:
        """``(free, total)`` bytes of ``device``'s memory (device-wide, all processes)."""
        free, total = ctypes.c_uint64(0), ctypes.c_uint64(0)
        self._cuda_call(
            "kvs_cuda_mem_get_info",
            abi.device_index(device),
            ctypes.byref(free),
            ctypes.byref(total),
        )
        return free.value, total.value

    def malloc(self, device: int, nbytes: int) -> int:
        """``nbytes`` of ``device``'s memory; the device address of its first byte.

        Give it back with :meth:`free`. Raises :class:`KernelError` (named
        ``cudaErrorMemoryAllocation`` when the device is full).
        """
        if not 1 <= nbytes <= abi.U64_MAX:
            raise ValueError(f"nbytes must be >= 1, not {nbytes}")
        address = ctypes.c_uint64(0)
        self._cuda_call("kvs_cuda_malloc", abi.device_index(device), nbytes, ctypes.byref(address))
        return address.value

    def free(self, device: int, address: int) -> None:
        """Give back memory :meth:`malloc` allocated (waits for the device's queued work)."""
        self._cuda_call(
            "kvs_cuda_free", abi.device_index(device), abi.address_arg(address, "address")
        )

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: Any = 0) -> None:
        """Queue a copy of ``nbytes`` from ``src`` to ``dst`` on ``stream`` and return.

        Both are addresses the stream's device uses (device memory, or pinned
        host memory by its device address); the runtime reads the direction
        from them. Like :meth:`gather`, it runs on the current device, and both
        ranges must stay valid until the stream passes the copy.
        """
        if not 0 <= nbytes <= abi.U64_MAX:
            raise ValueError(f"nbytes must be >= 0, not {nbytes}")
        self._cuda_call(
            "kvs_cuda_memcpy_async",
            abi.address_arg(dst, "dst"),
            abi.address_arg(src, "src"),
            nbytes,
            abi.stream_handle(stream),
        )

    def memcpy_batch_async(
        self,
        dsts: IntArray,
        srcs: IntArray,
        sizes: IntArray,
        stream: Any,
        src_access_any: bool = False,
    ) -> None:
        """Queue the copies ``srcs[i] -> dsts[i]`` of ``sizes[i]`` bytes on ``stream`` in
        one driver call (``cudaMemcpyBatchAsync``): vLLM's own batched DMA
        (``swap_blocks_batch``), which ``kvstrata bench transfer`` measures beside
        the sidecar's copy paths. ``stream`` must not be the legacy default stream.

        Raises ValueError for lists of different lengths or values outside 64 bits,
        and :class:`KernelError` (``cudaErrorNotSupported`` before CUDA 12.8).
        """
        d = abi.int_array(dsts, "dsts", np.uint64, 1, abi.U64_MAX)
        s = abi.int_array(srcs, "srcs", np.uint64, 1, abi.U64_MAX)
        n = abi.int_array(sizes, "sizes", np.uint64, 0, abi.U64_MAX)
        if not len(d) == len(s) == len(n):
            raise ValueError(f"{len(d)} dsts, {len(s)} srcs and {len(n)} sizes")
        if abi.stream_handle(stream) == 0:
            raise ValueError("a batched copy needs a stream of its own, not the legacy default")
        self._cuda_call(
            "kvs_cuda_memcpy_batch_async",
            d.ctypes.data, s.ctypes.data, n.ctypes.data, len(d), int(bool(src_access_any)),
            abi.stream_handle(stream),
        )  # fmt: skip

    def _cuda_call(self, fn: str, *args: Any) -> None:
        if self.backend != "cuda":
            raise RuntimeError(f"{fn} is in the CUDA library only, this is the {self.backend} one")
        self._check(fn, getattr(self._lib, fn)(*args))

    def _check(self, what: str, code: int) -> None:
        if code == 0:
            return
        if self.backend == "cuda":
            name = self._lib.kvs_cuda_error_name(code).decode()
            text = self._lib.kvs_cuda_error_string(code).decode()
        else:
            name, text = "error", "host library error"
        raise KernelError(what, code, name, text)
