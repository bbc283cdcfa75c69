"""The ``csrc/`` libraries (the CUDA kernels, their host build): which one loads, and from where.

Why a C ABI and ctypes: the kernels know nothing of torch or Python, so the
CUDA library builds without torch (or a GPU) and one binding
(:class:`~kvstrata.sidecar.transfer.kernel_binding.TransferLibrary`) drives
both libraries. The CUDA library moves all layers of a batch of chunks in
one launch on the caller's stream; the host library runs the same index
code (``csrc/kvs_index.h``) with memcpy, for tests on machines without a
GPU and as a CPU copy path. Both move bytes by a :class:`CopyPlan` (the
byte model is in :mod:`kvstrata.sidecar.transfer.plan`). This module finds,
checks and loads them, once per process.

Usage::

    lib = load_cuda()              # None where the kernels cannot run
    if lib is None:
        log.info("csrc kernels unavailable: %s", cuda_unavailable_reason())
    else:
        lib.gather(plan, block_ids, chunk_addresses, blocks_per_chunk,
                   stream=torch.cuda.current_stream().cuda_stream)

Where the libraries come from, in order:

1. the copies installed beside this module by the install step
   (``setup.py``; the CUDA one only where nvcc was present);
2. in a source checkout (``csrc/`` at hand), an installed copy built from
   other sources than the checkout's is never used: the library is rebuilt
   from the checkout into the cache directory
   (:func:`kvstrata.sidecar.transfer.csrc_build.cache_dir`), keyed by a
   hash of the sources, so an edited source rebuilds and an unchanged one
   compiles once.

``KVSTRATA_CUDA_KERNELS=0`` makes :func:`load_cuda` return None (the
torch copy path is used instead).

The CUDA library also carries the runtime calls the sidecar's ipc mode
needs without torch: methods of the binding that only the ``cuda`` backend
has (see :mod:`kvstrata.sidecar.transfer.kernel_binding`).
"""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path

from kvstrata.sidecar.transfer import abi, csrc_build
from kvstrata.sidecar.transfer.csrc_build import CSrcBuildError, Library
from kvstrata.sidecar.transfer.kernel_binding import TransferLibrary

__all__ = ["ABI_VERSION", "cuda_unavailable_reason", "installed_path", "load_cuda", "load_host"]

# Must equal KVS_ABI_VERSION in csrc/kvs_abi.h.
ABI_VERSION = 4


class _Unavailable(Exception):
    """Why the CUDA library cannot run here (the reason :func:`load_cuda` keeps)."""


def _open(path: Path) -> TransferLibrary:
    """dlopen ``path`` and check it speaks this ABI (OSError / CSrcBuildError otherwise)."""
    cdll = ctypes.CDLL(str(path))
    cdll.kvs_abi_version.restype = ctypes.c_int
    version = cdll.kvs_abi_version()
    if version != ABI_VERSION:
        raise CSrcBuildError(f"{path} speaks ABI {version}, this binding {ABI_VERSION}")
    abi.declare(cdll)
    return TransferLibrary(path, cdll)


def installed_path(library: Library) -> Path:
    """Where the install step puts ``library`` (beside this module, not resolved:
    an editable install links the module but builds the library in its own tree)."""
    return Path(__file__).parent / library.filename


def _load(library: Library) -> TransferLibrary:
    """The installed library if it is current, else one built from the checkout.

    Raises CSrcBuildError (or OSError from dlopen) saying why neither works.
    """
    installed = installed_path(library)
    csrc = csrc_build.repo_csrc_dir()
    if csrc is None:
        if not installed.is_file():
            raise CSrcBuildError(
                f"{library.filename} was not built at install and no csrc/ is at hand"
            )
        return _open(installed)
    stale = ""
    if installed.is_file():
        try:
            lib = _open(installed)
        except CSrcBuildError as exc:  # another ABI: it is older (or newer) than the checkout
            stale = f"{exc}; "
        else:
            if lib.source_hash == csrc_build.source_hash(csrc, library):
                return lib
            stale = f"the installed {library.filename} was built from other sources than {csrc}; "
    try:
        return _open(csrc_build.build(library, csrc))
    except CSrcBuildError as exc:
        raise CSrcBuildError(f"{stale}{exc}") from None


_lock = threading.Lock()
_host: TransferLibrary | None = None
_cuda: TransferLibrary | None = None
_cuda_reason: str | None = None
_cuda_probed = False


def load_host() -> TransferLibrary:
    """The host library (built with the C++ compiler on first use if need be).

    Raises :class:`CSrcBuildError` when it is neither installed nor buildable.
    """
    global _host
    with _lock:
        if _host is None:
            _host = _load(csrc_build.HOST)
        return _host


def load_cuda() -> TransferLibrary | None:
    """The CUDA library, or None where it cannot run (see :func:`cuda_unavailable_reason`).

    None when disabled (``KVSTRATA_CUDA_KERNELS=0``), when it was not built
    (no nvcc at install) and cannot be, or when the CUDA runtime finds no
    usable driver or device. The answer is decided once per process.
    """
    global _cuda, _cuda_reason, _cuda_probed
    with _lock:
        if not _cuda_probed:
            _cuda_probed = True
            try:
                _cuda = _probe_cuda()
            except (_Unavailable, CSrcBuildError, OSError) as exc:
                _cuda_reason = str(exc)
        return _cuda


def cuda_unavailable_reason() -> str | None:
    """Why :func:`load_cuda` returns None, for logs and selftests; None when it does not."""
    load_cuda()
    return _cuda_reason


def _probe_cuda() -> TransferLibrary:
    if os.environ.get("KVSTRATA_CUDA_KERNELS", "1") == "0":
        raise _Unavailable("disabled by KVSTRATA_CUDA_KERNELS=0")
    lib = _load(csrc_build.CUDA)
    runtime, driver = ctypes.c_int32(0), ctypes.c_int32(0)
    lib._lib.kvs_cuda_versions(ctypes.byref(runtime), ctypes.byref(driver))
    count = ctypes.c_int32(0)
    code = lib._lib.kvs_cuda_device_count(ctypes.byref(count))
    versions = f"runtime {_version(runtime.value)}, driver {_version(driver.value)}"
    if code != 0:
        name = lib._lib.kvs_cuda_error_name(code).decode()
        text = lib._lib.kvs_cuda_error_string(code).decode()
        raise _Unavailable(f"no usable CUDA device: {name} ({text}; {versions})")
    if count.value == 0:
        raise _Unavailable(f"no CUDA device ({versions})")
    return lib


def _version(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}" if v else "none"
