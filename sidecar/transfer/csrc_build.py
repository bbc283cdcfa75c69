"""How the ``csrc/`` libraries are compiled: one recipe for the install step and the binding.

Why one module: ``setup.py`` builds the libraries at install time and
:mod:`kvstrata.sidecar.transfer.kernels` rebuilds them on demand when the
installed ones are missing or older than the sources; both must use the
same commands and the same cache keys. This module uses only the standard
library, because ``setup.py`` loads it by path while the package is being
built (no torch, no numpy, no GPU needed).

Two libraries of one C ABI (``csrc/kvs_abi.h``), and a preload:

- ``libkvstrata-host.so``: ``csrc/kvs_host.cpp``, built with the C++
  compiler (``$CXX`` or ``g++``) as ``-O2 -shared -fPIC``.
- ``libkvstrata-cuda.so``: ``csrc/kvs_transfer.cu`` (the kernels) and
  ``csrc/kvs_ipc.cu`` (the CUDA runtime calls of ipc mode), built with ``nvcc``
  for :data:`DEFAULT_ARCHS` (those this nvcc accepts; ``KVSTRATA_CUDA_ARCHS``
  overrides, e.g. ``"90"`` or ``"80;90"``) as SASS, plus PTX of the lowest
  arch so newer GPUs JIT it. cudart is linked statically and its symbols
  hidden: the library dlopens on machines without the CUDA toolkit and never
  clashes with torch's own cudart.
- ``libkvstrata-acceptguard.so``: ``csrc/kvs_accept_guard.c``, built with the
  C compiler (``$CC``, ``gcc`` or ``cc``) as ``-O2 -shared -fPIC -pthread``
  and installed into ``kvstrata/sidecar/``: the sidecar preloads it so that
  no accept in the process fails for want of a descriptor
  (:mod:`kvstrata.sidecar.acceptguard`).

Each library embeds :func:`source_hash` of the sources it was built from
(``kvs_source_hash()``), so a loader can tell a stale build from a current
one. Built files are kept under a cache directory keyed by that hash and
the compile flags, so an unchanged tree never compiles twice.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

# Bump when a command line changes in a way the sources do not show.
RECIPE_VERSION = 2  # 2: a library may compile several sources

# Compute capabilities compiled as SASS: A100 (8.x runs sm_80 code), H100/H200,
# B200 (10.x), RTX 50 / RTX PRO (12.x). Intersected with what nvcc accepts.
DEFAULT_ARCHS: tuple[str, ...] = ("80", "90", "100", "120")


class CSrcBuildError(RuntimeError):
    """A csrc library could not be compiled (the message carries the compiler output)."""


@dataclass(frozen=True, slots=True)
class Library:
    """One library of the C ABI: what it is built from and what it is called."""

    kind: str  # "host", "cuda" or "preload"
    filename: str
    headers: tuple[str, ...]  # file names in csrc/ the compiled ones include
    compiled: tuple[str, ...]  # file names in csrc/ handed to the compiler, in order
    package: str = "kvstrata.sidecar.transfer"  # where the install step puts it

    @property
    def sources(self) -> tuple[str, ...]:
        """Every file the library is built from (what :func:`source_hash` covers)."""
        return self.headers + self.compiled


_HEADERS = ("kvs_abi.h", "kvs_common.h", "kvs_device_guard.h", "kvs_index.h", "kvs_uuid.h")
HOST = Library("host", "libkvstrata-host.so", _HEADERS, ("kvs_host.cpp",))
CUDA = Library("cuda", "libkvstrata-cuda.so", _HEADERS, ("kvs_transfer.cu", "kvs_ipc.cu"))
ACCEPT_GUARD = Library(
    "preload", "libkvstrata-acceptguard.so", (), ("kvs_accept_guard.c",), "kvstrata.sidecar"
)


def repo_csrc_dir() -> Path | None:
    """The ``csrc/`` directory of a source checkout, or None in an installed wheel.

    ``KVSTRATA_CSRC_DIR`` names it explicitly. Otherwise it is found beside
    this file's real location (the editable install links into the checkout).
    """
    explicit = os.environ.get("KVSTRATA_CSRC_DIR")
    if explicit:
        return Path(explicit)
    here = Path(__file__).resolve().parent  # <repo>/sidecar/transfer
    candidate = here.parent.parent / "csrc"
    return candidate if (candidate / HOST.compiled[0]).is_file() else None


def cache_dir() -> Path:
    """Where on-demand builds go: ``$KVSTRATA_CACHE_DIR``, else the XDG cache."""
    explicit = os.environ.get("KVSTRATA_CACHE_DIR")
    if explicit:
        return Path(explicit) / "csrc"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "kvstrata" / "csrc"


def source_hash(csrc: Path, library: Library) -> str:
    """sha256 (hex) of the library's sources: names and bytes, in a fixed order."""
    digest = hashlib.sha256(f"kvstrata-csrc {library.kind}\n".encode())
    for name in library.sources:
        data = (csrc / name).read_bytes()
        digest.update(f"{name} {len(data)}\n".encode())
        digest.update(data)
    return digest.hexdigest()


def find_cxx() -> str | None:
    """The C++ compiler: ``$CXX``, else ``g++``, else ``c++`` on PATH."""
    explicit = os.environ.get("CXX")
    if explicit:
        return explicit
    return shutil.which("g++") or shutil.which("c++")


def find_cc() -> str | None:
    """The C compiler: ``$CC``, else ``gcc``, else ``cc`` on PATH."""
    explicit = os.environ.get("CC")
    if explicit:
        return explicit
    return shutil.which("gcc") or shutil.which("cc")


def find_nvcc() -> str | None:
    """nvcc: ``$NVCC``, ``$CUDA_HOME/bin/nvcc``, PATH, then ``/usr/local/cuda/bin``."""
    explicit = os.environ.get("NVCC")
    if explicit:
        return explicit
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if home and os.access(Path(home) / "bin" / "nvcc", os.X_OK):
            return str(Path(home) / "bin" / "nvcc")
    found = shutil.which("nvcc")
    if found:
        return found
    default = Path("/usr/local/cuda/bin/nvcc")
    return str(default) if os.access(default, os.X_OK) else None


def cuda_archs(nvcc: str) -> list[str]:
    """Compute capabilities to compile, e.g. ``["80", "90", "100", "120"]``.

    ``KVSTRATA_CUDA_ARCHS`` (``;`` or ``,`` separated) wins; otherwise
    :data:`DEFAULT_ARCHS` minus those this nvcc does not know (CUDA 13
    dropped everything before sm_75; CUDA 12.0 knows no sm_100).
    """
    explicit = os.environ.get("KVSTRATA_CUDA_ARCHS")
    if explicit:
        return [a.strip() for a in explicit.replace(",", ";").split(";") if a.strip()]
    try:
        out = subprocess.run(
            [nvcc, "--list-gpu-code"], capture_output=True, text=True, check=False
        ).stdout
    except OSError as exc:
        raise CSrcBuildError(f"cannot run {nvcc}: {exc}") from None
    known = {line.strip().removeprefix("sm_") for line in out.split()}
    archs = [a for a in DEFAULT_ARCHS if a in known]
    if not archs:
        raise CSrcBuildError(f"{nvcc} supports none of sm_{', sm_'.join(DEFAULT_ARCHS)}")
    return archs


def gencode_flags(archs: list[str]) -> list[str]:
    """SASS for every arch and PTX of the lowest, which any newer GPU can JIT."""
    flags = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    lowest = min(archs, key=int)
    flags.append(f"-gencode=arch=compute_{lowest},code=compute_{lowest}")
    return flags


def compile_command(library: Library, csrc: Path, output: Path, digest: str) -> list[str]:
    """The compiler command line that builds ``library`` from ``csrc`` into ``output``."""
    define = f'-DKVS_SOURCE_HASH="{digest}"'
    sources = [str(csrc / name) for name in library.compiled]
    if library.kind == "host":
        cxx = find_cxx()
        if cxx is None:
            raise CSrcBuildError("no C++ compiler found (set CXX or install g++)")
        return [
            cxx, "-O2", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden",
            define, "-o", str(output), *sources,
        ]  # fmt: skip
    if library.kind == "preload":
        cc = find_cc()
        if cc is None:
            raise CSrcBuildError("no C compiler found (set CC or install gcc)")
        return [
            cc, "-O2", "-std=gnu11", "-shared", "-fPIC", "-pthread", "-fvisibility=hidden",
            define, "-o", str(output), *sources, "-ldl",
        ]  # fmt: skip
    nvcc = find_nvcc()
    if nvcc is None:
        raise CSrcBuildError("nvcc not found (set NVCC or CUDA_HOME)")
    return [
        nvcc, "-O3", "-std=c++17", "-shared", "--cudart=static",
        "-Xcompiler=-fPIC,-fvisibility=hidden", "-Xlinker=--exclude-libs,ALL",
        f"--threads={min(4, os.cpu_count() or 1)}",
        *gencode_flags(cuda_archs(nvcc)), define, "-o", str(output), *sources,
    ]  # fmt: skip


def build(library: Library, csrc: Path, into: Path | None = None) -> Path:
    """Compile ``library`` from ``csrc`` unless an identical build is cached; return its path.

    The file is ``<into>/<name>-<key>.so`` where the key covers the sources
    and the command line, so a concurrent or repeated build of the same tree
    reuses it, and an edited source gets a new file. Writes go to a temporary
    name first and are renamed into place, so a reader never sees half a file.
    Raises :class:`CSrcBuildError` with the compiler's output on failure.
    """
    into = into or cache_dir()
    digest = source_hash(csrc, library)
    placeholder = "@OUTPUT@"
    command = compile_command(library, csrc, Path(placeholder), digest)
    sources = {str(csrc / name) for name in library.compiled}
    # The key leaves out where the tree is: the same sources and flags are the same build.
    flags = " ".join(a for a in command if a != placeholder and a not in sources)
    key = hashlib.sha256(f"{RECIPE_VERSION}\n{flags}".encode()).hexdigest()[:16]
    stem = library.filename.removesuffix(".so")
    target = into / f"{stem}-{key}.so"
    if target.is_file():
        return target
    into.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{stem}-", suffix=".so", dir=into)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        command = [str(tmp) if a == placeholder else a for a in command]
        try:
            done = subprocess.run(command, capture_output=True, text=True, check=False)
        except OSError as exc:
            raise CSrcBuildError(f"cannot run {command[0]}: {exc}") from None
        if done.returncode != 0:
            raise CSrcBuildError(
                f"building {library.filename} failed ({done.returncode}): {' '.join(command)}\n"
                f"{done.stdout[-4000:]}{done.stderr[-4000:]}"
            )
        tmp.chmod(0o755)  # mkstemp made it private; other users of the cache dlopen it too
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target
