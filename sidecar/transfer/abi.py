"""The C ABI of the ``csrc/`` libraries, Python side: ctypes declarations and argument checks.

Why apart from :mod:`kvstrata.sidecar.transfer.kernels`: every value that
crosses into C is range-checked here first (a wrong width or a null address
would be memory corruption in C, not an exception), and these tables must
match ``csrc/kvs_abi.h`` line by line; keeping them in one short module makes
that comparison easy. :mod:`kernels` holds the library object and its loading.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from kvstrata.sidecar.transfer.plan import CopyPlan

I32_MAX = 2**31 - 1
I64_MAX = 2**63 - 1
U64_MAX = 2**64 - 1

IPC_HANDLE_BYTES = 64  # cudaIpcMemHandle_t, cudaIpcEventHandle_t

IntArray = Sequence[int] | np.ndarray

COPY_ARGTYPES = [
    ctypes.c_void_p,  # layer_addresses
    ctypes.c_int32,  # num_layers
    ctypes.c_int64,  # block_stride
    ctypes.c_int32,  # num_segments
    ctypes.c_int64,  # segment_stride
    ctypes.c_int64,  # segment_bytes
    ctypes.c_int32,  # block_outer
    ctypes.c_void_p,  # block_ids
    ctypes.c_int32,  # blocks_per_chunk
    ctypes.c_void_p,  # chunk_addresses
    ctypes.c_int64,  # num_chunks
    ctypes.c_int32,  # max_ctas
    ctypes.c_uint64,  # stream
]

_I32P = ctypes.POINTER(ctypes.c_int32)
_U64P = ctypes.POINTER(ctypes.c_uint64)
# The runtime calls of ipc mode (csrc/kvs_ipc.cu); every one returns a cudaError_t.
CUDA_IPC_ARGTYPES: dict[str, list[Any]] = {
    "kvs_cuda_device_by_uuid": [ctypes.c_char_p, _I32P],
    "kvs_cuda_set_device": [ctypes.c_int32],
    # Handles go as c_char_p: a pointer to the bytes object's own 64 bytes (NULs and all).
    "kvs_cuda_ipc_open": [ctypes.c_int32, ctypes.c_char_p, _U64P],
    "kvs_cuda_ipc_close": [ctypes.c_int32, ctypes.c_uint64],
    "kvs_cuda_mem_range": [ctypes.c_int32, ctypes.c_uint64, _U64P, _U64P],
    "kvs_cuda_stream_create": [ctypes.c_int32, _U64P],
    "kvs_cuda_stream_destroy": [ctypes.c_int32, ctypes.c_uint64],
    "kvs_cuda_stream_wait_ipc_event": [ctypes.c_int32, ctypes.c_uint64, ctypes.c_char_p],
    "kvs_cuda_ipc_event_query": [ctypes.c_int32, ctypes.c_char_p, _I32P],
    "kvs_cuda_host_register": [ctypes.c_void_p, ctypes.c_uint64, _U64P, _I32P],
    "kvs_cuda_host_unregister": [ctypes.c_void_p],
    "kvs_cuda_mem_get_info": [ctypes.c_int32, _U64P, _U64P],
    "kvs_cuda_malloc": [ctypes.c_int32, ctypes.c_uint64, _U64P],
    "kvs_cuda_free": [ctypes.c_int32, ctypes.c_uint64],
    "kvs_cuda_memcpy_async": [ctypes.c_uint64] * 4,
    "kvs_cuda_memcpy_batch_async": [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_uint64,
        ctypes.c_int32,
        ctypes.c_uint64,
    ],
}


def stream_handle(stream: Any) -> int:
    handle = getattr(stream, "cuda_stream", stream)
    if not isinstance(handle, int) or not 0 <= handle <= U64_MAX:
        raise ValueError(f"stream must be a cudaStream_t handle (int >= 0), not {stream!r}")
    return handle


def device_index(device: int) -> int:
    if not isinstance(device, int) or not 0 <= device <= I32_MAX:
        raise ValueError(f"device must be a CUDA device index (int >= 0), not {device!r}")
    return device


def address_arg(value: int, name: str) -> int:
    if not isinstance(value, int) or not 1 <= value <= U64_MAX:
        raise ValueError(f"{name} must be a non-null address, not {value!r}")
    return value


def ipc_handle_arg(value: bytes, name: str) -> bytes:
    if not isinstance(value, bytes) or len(value) != IPC_HANDLE_BYTES:
        raise ValueError(f"{name} must be {IPC_HANDLE_BYTES} bytes (a CUDA IPC handle)")
    return value


def ascii_arg(text: str, name: str) -> bytes:
    try:
        return text.encode("ascii")
    except (AttributeError, UnicodeEncodeError):
        raise ValueError(f"{name} must be an ASCII string, not {text!r}") from None


def int_array(values: IntArray, name: str, dtype: type, low: int, high: int) -> np.ndarray:
    """``values`` as a contiguous 1-D array of ``dtype``; ValueError unless all in [low, high]."""
    try:
        arr = np.asarray(values)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"{name} must be a sequence of integers: {exc}") from None
    if arr.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, not of shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype=dtype)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{name} must be integers, not {arr.dtype}")
    bad = (arr < low) | (arr > high)
    if bad.any():
        value = int(arr[int(np.argmax(bad))])
        if name == "block_ids" and value > high:
            raise ValueError(f"block id {value} >= num_blocks {high + 1}")
        raise ValueError(f"{name}: {value} is outside [{low}, {high}]")
    return np.ascontiguousarray(arr, dtype=dtype)


def plan_layers(plan: CopyPlan) -> np.ndarray:
    """The plan's layer addresses after checking every scalar fits the ABI."""
    checks = (
        ("num_layers", plan.num_layers, 1, I32_MAX),
        ("num_blocks", plan.num_blocks, 0, I64_MAX),
        ("block_stride", plan.block_stride, 0, I64_MAX),
        ("num_segments", plan.num_segments, 1, I32_MAX),
        ("segment_stride", plan.segment_stride, 0, I64_MAX),
        ("segment_bytes", plan.segment_bytes, 1, I64_MAX),
    )
    for field, value, low, high in checks:
        if not low <= value <= high:
            raise ValueError(f"plan.{field} = {value} is outside [{low}, {high}]")
    return int_array(plan.layer_addresses, "plan.layer_addresses", np.uint64, 1, U64_MAX)


def declare(cdll: ctypes.CDLL) -> None:
    """Set argument and result types (ctypes would otherwise pass ints as C int)."""
    for fn in ("kvs_gather", "kvs_scatter"):
        getattr(cdll, fn).argtypes = COPY_ARGTYPES
        getattr(cdll, fn).restype = ctypes.c_int
    cdll.kvs_vector_width.argtypes = [
        ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
        ctypes.c_void_p, ctypes.c_int64,
    ]  # fmt: skip
    cdll.kvs_vector_width.restype = ctypes.c_int
    cdll.kvs_abi_version.restype = ctypes.c_int
    cdll.kvs_source_hash.restype = ctypes.c_char_p
    cdll.kvs_backend.restype = ctypes.c_char_p
    cdll.kvs_uuid_parse.argtypes = [ctypes.c_char_p, ctypes.c_void_p]
    cdll.kvs_uuid_parse.restype = ctypes.c_int
    if cdll.kvs_backend() == b"cuda":
        cdll.kvs_cuda_device_count.argtypes = [ctypes.POINTER(ctypes.c_int32)]
        cdll.kvs_cuda_versions.argtypes = [ctypes.POINTER(ctypes.c_int32)] * 2
        for fn in ("kvs_cuda_error_name", "kvs_cuda_error_string"):
            getattr(cdll, fn).argtypes = [ctypes.c_int32]
            getattr(cdll, fn).restype = ctypes.c_char_p
        cdll.kvs_cuda_stream_synchronize.argtypes = [ctypes.c_uint64]
        for fn, argtypes in CUDA_IPC_ARGTYPES.items():
            getattr(cdll, fn).argtypes = argtypes
            getattr(cdll, fn).restype = ctypes.c_int
