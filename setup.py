"""Install step that compiles the ``csrc/`` transfer libraries into the package.

pyproject.toml holds everything else; this file only adds the two C ABI
libraries (``libkvstrata-host.so``, ``libkvstrata-cuda.so``) and the
sidecar's accept guard (``libkvstrata-acceptguard.so``, preloaded; it needs
only a C compiler) as extension entries, so wheels are platform-tagged and
editable installs link them. The
commands are :mod:`kvstrata.sidecar.transfer.csrc_build`'s, loaded here by
path: the build needs neither torch nor a GPU, only g++ and (for the CUDA
library) nvcc.

``KVSTRATA_BUILD_CUDA`` / ``KVSTRATA_BUILD_HOST`` / ``KVSTRATA_BUILD_PRELOAD``:
``auto`` (default) builds a library where its compiler is found and skips it
with a message where the compiler is missing or fails; ``1`` makes a missing compiler or a failed
build an error; ``0`` skips. A package without the CUDA library still works:
the torch copy path stands in, and the host library is built on first use.

Built files are cached in ``build/csrc`` under a hash of sources and flags,
so ``make dev`` on an unchanged tree copies instead of compiling.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import types
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def _load_recipe() -> types.ModuleType:
    """csrc_build.py, loaded by path: the package is not importable while it is built."""
    spec = importlib.util.spec_from_file_location(
        "_kvstrata_csrc_build", ROOT / "sidecar" / "transfer" / "csrc_build.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


recipe = _load_recipe()


class CSrcLibrary(Extension):
    """A csrc library installed into its package's folder (no Python module)."""

    def __init__(self, library: object) -> None:
        self.library = library
        name = f"{library.package}.{library.filename.removesuffix('.so')}"
        super().__init__(name, sources=[f"csrc/{s}" for s in library.sources])


class BuildCSrc(build_ext):
    """build_ext that compiles CSrcLibrary entries with the csrc_build recipe."""

    def get_ext_filename(self, fullname: str) -> str:
        # Called with the dotted name and (by distutils) with its last part alone.
        for ext in self.extensions:
            if isinstance(ext, CSrcLibrary) and fullname in (ext.name, ext.name.split(".")[-1]):
                return os.path.join(*fullname.split(".")[:-1], ext.library.filename)
        return super().get_ext_filename(fullname)

    def build_extensions(self) -> None:
        built = []
        for ext in self.extensions:
            if not isinstance(ext, CSrcLibrary):
                self.build_extension(ext)
                built.append(ext)
            elif self._build_library(ext):
                built.append(ext)
        # Skipped libraries are no outputs: wheels and editable links list what exists.
        self.extensions = built

    def _build_library(self, ext: CSrcLibrary) -> bool:
        kind = ext.library.kind
        mode = os.environ.get(f"KVSTRATA_BUILD_{kind.upper()}", "auto").lower()
        target = Path(self.get_ext_fullpath(ext.name))
        # A library left in the build tree by an earlier build must not ship instead.
        target.unlink(missing_ok=True)
        if mode == "0":
            print(f"kvstrata: {ext.library.filename} skipped (KVSTRATA_BUILD_{kind.upper()}=0)")
            return False
        try:
            path = recipe.build(ext.library, ROOT / "csrc", ROOT / "build" / "csrc")
        except recipe.CSrcBuildError as exc:
            if mode == "1":
                raise
            print(f"kvstrata: {ext.library.filename} not built: {exc}", file=sys.stderr)
            return False
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
        print(f"kvstrata: {ext.library.filename} <- {path.name}")
        return True


setup(
    ext_modules=[CSrcLibrary(lib) for lib in (recipe.HOST, recipe.CUDA, recipe.ACCEPT_GUARD)],
    cmdclass={"build_ext": BuildCSrc},
)
