"""csrc/ compiles cleanly (nvcc for sm_80 and sm_90, g++), builds once per source tree,
and the binding never runs a library built from other sources or for another ABI."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvstrata.sidecar.transfer import csrc_build, kernels
from kvstrata.sidecar.transfer.csrc_build import HOST, CSrcBuildError, build, source_hash

CSRC = Path(__file__).resolve().parents[2] / "csrc"
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
    header.write_text(
        header.read_text().replace("#define KVS_ABI_VERSION 1", "#define KVS_ABI_VERSION 99")
    )
    with pytest.raises(CSrcBuildError, match="speaks ABI 99"):
        kernels._open(build(HOST, tree, tmp_path / "cache"))


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
