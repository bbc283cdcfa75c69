"""csrc/ compiles cleanly (nvcc for sm_80 and sm_90, g++), builds once per source tree,
and the binding never runs a library built from other sources or for another ABI."""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvstrata.sidecar.transfer import abi, csrc_build, kernels
from kvstrata.sidecar.transfer.csrc_build import HOST, CSrcBuildError, build, source_hash

CSRC = Path(__file__).resolve().parents[3] / "csrc"
NVCC = csrc_build.find_nvcc()
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found (no CUDA toolkit here)")


@needs_nvcc
@pytest.mark.parametrize("source", sorted(p.name for p in CSRC.glob("*.cu")))
def test_every_cuda_source_compiles_for_sm80_and_sm90_without_a_warning(
    tmp_path: Path, source: str
) -> None:
    command = [
        NVCC, "-c", "-std=c++17", "-O3", "--Werror=all-warnings",
        "-Xcompiler=-Wall,-Wextra,-Werror",
        "-Xptxas=-warn-spills,-warn-lmem-usage,-Werror",  # a copy kernel must not spill
        "-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=sm_90",
        str(CSRC / source), "-o", str(tmp_path / "out.o"),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_host_build_compiles_without_a_warning_under_pedantic_cxx17(tmp_path: Path) -> None:
    cxx = csrc_build.find_cxx()
    assert cxx is not None, "no C++ compiler: the host library cannot be built"
    command = [
        cxx, "-std=c++17", "-O2", "-Wall", "-Wextra", "-Wpedantic", "-Wconversion", "-Werror",
        "-fsyntax-only", str(CSRC / "kvs_host.cpp"),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_accept_guard_builds_without_a_warning_and_exports_only_its_own_symbols(
    tmp_path: Path,
) -> None:
    cc = csrc_build.find_cc()
    assert cc is not None, "no C compiler: the accept guard cannot be built"
    command = [
        cc, "-std=gnu11", "-O2", "-Wall", "-Wextra", "-Wconversion", "-Werror", "-fsyntax-only",
        str(CSRC / "kvs_accept_guard.c"),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    built = build(csrc_build.ACCEPT_GUARD, CSRC, tmp_path)
    symbols = subprocess.run(
        ["nm", "-D", "--defined-only", str(built)], capture_output=True, text=True, check=True
    ).stdout
    exported = {line.split()[-1] for line in symbols.splitlines() if " T " in line}
    assert exported == {
        "accept", "accept4", "kvs_accept_guard_dropped", "kvs_accept_guard_spare",
        "kvs_accept_guard_spare_missing",
    }  # fmt: skip


def test_csrc_includes_only_standard_and_cuda_runtime_headers() -> None:
    allowed = {"stdint.h", "string.h", "atomic", "vector", "cuda_runtime.h"}
    own = {p.name for p in CSRC.glob("*.h")}
    for path in [*CSRC.glob("*.h"), *CSRC.glob("*.cpp"), *CSRC.glob("*.cu")]:
        for name in re.findall(r'^#include [<"]([^>"]+)[>"]', path.read_text(), re.M):
            assert name in allowed | own, f"{path.name} includes {name}"


def test_the_binding_and_the_header_agree_on_the_abi_version() -> None:
    header = (CSRC / "kvs_abi.h").read_text()
    assert f"#define KVS_ABI_VERSION {kernels.ABI_VERSION}\n" in header


def test_an_unchanged_tree_compiles_once_and_an_edited_source_builds_anew(tmp_path: Path) -> None:
    tree = shutil.copytree(CSRC, tmp_path / "csrc")
    cache = tmp_path / "cache"
    first = build(HOST, tree, cache)
    stamp = first.stat().st_mtime_ns
    assert build(HOST, tree, cache) == first
    assert first.stat().st_mtime_ns == stamp  # reused, not rebuilt

    with (tree / "kvs_index.h").open("a") as header:
        header.write("\n// an edit\n")
    edited = build(HOST, tree, cache)
    assert edited != first
    assert kernels._open(edited).source_hash == source_hash(tree, HOST)
    assert kernels._open(first).source_hash != source_hash(tree, HOST)


def test_a_compile_error_is_reported_with_the_compiler_output(tmp_path: Path) -> None:
    tree = shutil.copytree(CSRC, tmp_path / "csrc")
    with (tree / "kvs_host.cpp").open("a") as source:
        source.write("\nthis is not C++;\n")
    with pytest.raises(CSrcBuildError, match=r"kvs_host\.cpp"):
        build(HOST, tree, tmp_path / "cache")


def test_an_installed_library_from_other_sources_is_rebuilt_from_the_checkout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tree = shutil.copytree(CSRC, tmp_path / "csrc")
    with (tree / "kvs_host.cpp").open("a") as source:
        source.write("\n// older sources\n")
    stale = build(HOST, tree, tmp_path / "stale")
    monkeypatch.setattr(kernels, "installed_path", lambda library: stale)
    monkeypatch.setenv("KVSTRATA_CACHE_DIR", str(tmp_path / "cache"))

    lib = kernels._load(HOST)
    assert lib.path != stale
    assert lib.source_hash == source_hash(CSRC, HOST)


def test_without_a_checkout_the_installed_library_is_used_as_it_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    installed = build(HOST, CSRC, tmp_path / "installed")
    monkeypatch.setattr(kernels, "installed_path", lambda library: installed)
    monkeypatch.setattr(csrc_build, "repo_csrc_dir", lambda: None)
    assert kernels._load(HOST).path == installed


def test_a_library_of_another_abi_version_is_refused(tmp_path: Path) -> None:
    tree = shutil.copytree(CSRC, tmp_path / "csrc")
    header = tree / "kvs_abi.h"
    current = f"#define KVS_ABI_VERSION {kernels.ABI_VERSION}\n"
    header.write_text(header.read_text().replace(current, "#define KVS_ABI_VERSION 99\n"))
    with pytest.raises(CSrcBuildError, match="speaks ABI 99"):
        kernels._open(build(HOST, tree, tmp_path / "cache"))


def test_an_installed_library_of_another_abi_is_rebuilt_from_the_checkout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tree = shutil.copytree(CSRC, tmp_path / "csrc")
    header = tree / "kvs_abi.h"
    current = f"#define KVS_ABI_VERSION {kernels.ABI_VERSION}\n"
    header.write_text(header.read_text().replace(current, "#define KVS_ABI_VERSION 99\n"))
    older = build(HOST, tree, tmp_path / "older")
    monkeypatch.setattr(kernels, "installed_path", lambda library: older)
    monkeypatch.setenv("KVSTRATA_CACHE_DIR", str(tmp_path / "cache"))

    lib = kernels._load(HOST)
    assert lib.path != older
    assert lib.source_hash == source_hash(CSRC, HOST)


# -- the ABI: header, exports and ctypes declarations agree -------------------

# C parameter types of kvs_abi.h -> the ctypes types that pass them correctly.
_U64P, _I32P = ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_int32)
CTYPES_FOR: dict[str, set[Any]] = {
    "int32_t": {ctypes.c_int32},
    "int64_t": {ctypes.c_int64},
    "uint64_t": {ctypes.c_uint64},
    "const uint64_t*": {ctypes.c_void_p},
    "const int64_t*": {ctypes.c_void_p},
    "const char*": {ctypes.c_char_p},
    "const void*": {ctypes.c_char_p, ctypes.c_void_p},
    "void*": {ctypes.c_void_p},
    "uint8_t*": {ctypes.c_void_p},
    "int32_t*": {_I32P},
    "uint64_t*": {_U64P},
}


def abi_functions() -> dict[str, list[str]]:
    """Every function kvs_abi.h declares -> its parameter types (names dropped)."""
    text = re.sub(r"//[^\n]*", "", (CSRC / "kvs_abi.h").read_text())
    functions = {}
    for name, params in re.findall(r"KVS_API\s+[\w\s*]+?\b(kvs_\w+)\s*\(([^)]*)\)", text):
        params = " ".join(params.split())
        types = []
        if params != "void":
            for param in params.split(","):
                words = param.replace("*", "* ").split()
                types.append(" ".join(words[:-1]).replace(" *", "*"))
        functions[name] = types
    return functions


def check_declarations(lib: kernels.TransferLibrary, names: list[str]) -> None:
    functions = abi_functions()
    for name in names:
        fn = getattr(lib._lib, name)  # AttributeError: not exported
        params = functions[name]
        if not params:
            assert not fn.argtypes, name
            continue
        assert fn.argtypes is not None, f"{name}: no argtypes declared"
        assert len(fn.argtypes) == len(params), f"{name}: {fn.argtypes} for {params}"
        for i, (c_type, declared) in enumerate(zip(params, fn.argtypes, strict=True)):
            assert declared in CTYPES_FOR[c_type], f"{name} argument {i}: {declared} for {c_type}"


def test_the_header_declares_the_functions_the_binding_calls() -> None:
    functions = abi_functions()
    assert "kvs_cuda_ipc_open" in functions
    assert functions["kvs_cuda_host_register"] == ["void*", "uint64_t", "uint64_t*", "int32_t*"]
    assert functions["kvs_cuda_malloc"] == ["int32_t", "uint64_t", "uint64_t*"]
    assert functions["kvs_cuda_free"] == ["int32_t", "uint64_t"]
    assert functions["kvs_cuda_memcpy_async"] == ["uint64_t"] * 4
    assert set(abi.CUDA_IPC_ARGTYPES) <= set(functions)


def test_the_host_library_exports_every_function_but_the_cuda_ones_as_declared() -> None:
    lib = kernels.load_host()
    host_names = [n for n in abi_functions() if not n.startswith("kvs_cuda_")]
    check_declarations(lib, host_names)
    for name in abi_functions():
        if name.startswith("kvs_cuda_"):
            assert not hasattr(lib._lib, name), f"the host library exports {name}"


@pytest.fixture(scope="module")
def cuda_lib(tmp_path_factory: pytest.TempPathFactory) -> kernels.TransferLibrary:
    if NVCC is None:
        pytest.skip("nvcc not found (no CUDA toolkit here)")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVSTRATA_CUDA_ARCHS", "80")  # one arch: the ABI, not the code, is tested
        return kernels._open(build(csrc_build.CUDA, CSRC, tmp_path_factory.mktemp("cuda")))


def test_the_cuda_library_exports_every_function_of_the_header_as_declared(
    cuda_lib: kernels.TransferLibrary,
) -> None:
    assert cuda_lib.backend == "cuda"
    check_declarations(cuda_lib, list(abi_functions()))


IPC_CALLS = (
    "import json, sys; from kvstrata.sidecar.transfer import kernels as k; "
    "from kvstrata.sidecar.transfer.kernel_binding import KernelError; "
    "lib = k._open(__import__('pathlib').Path(sys.argv[1])); out = {}\n"
    "calls = {\n"
    " 'device_by_uuid': lambda: lib.device_by_uuid('GPU-12345678-9abc-def0-1234-56789abcdef0'),\n"
    " 'set_device': lambda: lib.set_device(0),\n"
    " 'ipc_open': lambda: lib.ipc_open(0, bytes(64)),\n"
    " 'ipc_close': lambda: lib.ipc_close(0, 1 << 40),\n"
    " 'stream_create': lambda: lib.stream_create(0),\n"
    " 'stream_wait_ipc_event': lambda: lib.stream_wait_ipc_event(0, 1, bytes(64)),\n"
    " 'host_register': lambda: lib.host_register(1 << 40, 4096),\n"
    " 'mem_get_info': lambda: lib.mem_get_info(0),\n"
    " 'malloc': lambda: lib.malloc(0, 1 << 20),\n"
    " 'free': lambda: lib.free(0, 1 << 40),\n"
    " 'memcpy_async': lambda: lib.memcpy_async(1 << 40, 1 << 41, 4096, 0),\n"
    "}\n"
    "for name, call in calls.items():\n"
    "    try:\n"
    "        out[name] = repr(call())\n"
    "    except KernelError as exc:\n"
    "        out[name] = exc.name\n"
    "print(json.dumps(out))"
)


def test_without_a_visible_gpu_every_ipc_call_raises_naming_the_cuda_error(
    cuda_lib: kernels.TransferLibrary,
) -> None:
    done = subprocess.run(
        [sys.executable, "-c", IPC_CALLS, str(cuda_lib.path)], capture_output=True, text=True,
        check=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, timeout=120,
    )  # fmt: skip
    results = json.loads(done.stdout)
    assert len(results) == 11
    for name, result in results.items():
        # cudaErrorNoDevice with a driver, cudaErrorInsufficientDriver without one
        assert re.fullmatch(r"cudaError\w+", result), f"{name} returned {result}"


def test_the_cuda_library_refuses_a_malformed_uuid_before_asking_the_driver(
    cuda_lib: kernels.TransferLibrary,
) -> None:
    device = ctypes.c_int32(-1)
    code = cuda_lib._lib.kvs_cuda_device_by_uuid(b"GPU-not-a-uuid", ctypes.byref(device))
    assert cuda_lib._lib.kvs_cuda_error_name(code) == b"cudaErrorInvalidValue"
    assert device.value == -1


PROBE = (
    "import json; from kvstrata.sidecar.transfer import kernels as k; "
    "lib = k.load_cuda(); print(json.dumps([lib is None, k.cuda_unavailable_reason()]))"
)


def probe_cuda(**env: str) -> tuple[bool, str | None]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, check=True,
        env={**os.environ, **env}, timeout=300,
    )  # fmt: skip
    is_none, reason = json.loads(done.stdout)
    return is_none, reason


@needs_nvcc
def test_the_cuda_library_opens_without_a_visible_gpu_and_says_why_it_cannot_run() -> None:
    # No visible device (or no driver at all): the library still dlopens (cudart is
    # static) and the reason names the CUDA runtime's error.
    is_none, reason = probe_cuda(CUDA_VISIBLE_DEVICES="")
    assert is_none
    assert reason is not None
    assert re.match(r"no usable CUDA device: cudaError\w+ \(.+; runtime \d+\.\d+, driver", reason)


def test_kvstrata_cuda_kernels_0_turns_the_kernels_off() -> None:
    assert probe_cuda(KVSTRATA_CUDA_KERNELS="0") == (True, "disabled by KVSTRATA_CUDA_KERNELS=0")
