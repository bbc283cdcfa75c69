"""Copy the pure-Python ``kvstrata`` package into a directory (the injected init container).

Why: the vLLM container must import ``kvstrata.connector``; the webhook runs
this in the sidecar image (``python -m kvstrata.operator.install DIR``) to
fill a shared emptyDir that the vLLM container puts first on its
``PYTHONPATH``. Only kvstrata's ``.py`` files are copied (no bytecode, no
operator), so the copy works with whatever Python the vLLM image has.

Third-party modules the connector imports: pyzmq, cbor2, pydantic, numpy and
pyyaml are vLLM dependencies, so its image has them; msgpack is not, so it is
copied whole. Its compiled extension only loads on a Python with the same ABI
tag (the file name says which); on any other Python, msgpack falls back to
its own pure-Python implementation from the same copy.

Layout written: ``DIR/kvstrata/{__init__.py, sidecar/, connector/}``, each
with every subpackage (``sidecar/tiers/``, ``sidecar/transfer/`` ...), and
``DIR/msgpack/``.
"""

from __future__ import annotations

import importlib
import shutil
import sys
from pathlib import Path

TREES = ("kvstrata.sidecar", "kvstrata.connector")  # copied with all their subpackages
VENDORED = ("msgpack",)  # copied whole: not a vLLM dependency


def _directory(package: str) -> Path:
    return Path(next(iter(importlib.import_module(package).__path__)))


def packages() -> dict[str, Path]:
    """``kvstrata`` and every package under :data:`TREES` (the connector reaches
    into sidecar subpackages), with their directories; found on disk, so no
    subpackage is imported (some need torch, which this image lacks)."""
    found = {"kvstrata": _directory("kvstrata")}
    for tree in TREES:
        root = _directory(tree)
        for init in sorted(root.rglob("__init__.py")):
            found[".".join((tree, *init.parent.relative_to(root).parts))] = init.parent
    return found


def install(target: Path) -> list[Path]:
    """Copy each package's modules under ``target``; returns the files written."""
    written: list[Path] = []
    for name, source in packages().items():
        dest = target.joinpath(*name.split("."))
        dest.mkdir(parents=True, exist_ok=True)
        for path in sorted(source.glob("*.py")):
            out = dest / path.name
            shutil.copyfile(path.resolve(), out)  # resolve: editable installs link files
            written.append(out)
    for name in VENDORED:
        source = Path(next(iter(importlib.import_module(name).__path__)))
        dest = target / name
        shutil.copytree(
            source, dest, ignore=shutil.ignore_patterns("__pycache__"), dirs_exist_ok=True
        )
        written += sorted(p for p in dest.rglob("*") if p.is_file())
    return written


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m kvstrata.operator.install DIR", file=sys.stderr)
        return 2
    files = install(Path(args[0]))
    print(f"kvstrata: copied {len(files)} modules into {args[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
