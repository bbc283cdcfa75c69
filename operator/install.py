"""Copy the pure-Python ``kvstrata`` package into a directory (the injected init container).

Why: the vLLM container must import ``kvstrata.connector``; the webhook runs
this in the sidecar image (``python -m kvstrata.operator.install DIR``) to
fill a shared emptyDir that the vLLM container puts first on its
``PYTHONPATH``. Only ``.py`` files are copied (no bytecode, no operator), so
the copy works with whatever Python the vLLM image has. Third-party
dependencies (pyzmq, msgpack, pydantic, numpy) come from the vLLM image,
which already has them.

Layout written: ``DIR/kvstrata/{__init__.py, sidecar/, sidecar/tiers/, connector/}``.
"""

from __future__ import annotations

import importlib
import shutil
import sys
from pathlib import Path

PACKAGES = ("kvstrata", "kvstrata.sidecar", "kvstrata.sidecar.tiers", "kvstrata.connector")


def install(target: Path) -> list[Path]:
    """Copy each package's modules under ``target``; returns the files written."""
    written: list[Path] = []
    for name in PACKAGES:
        module = importlib.import_module(name)
        source = Path(next(iter(module.__path__)))
        dest = target.joinpath(*name.split("."))
        dest.mkdir(parents=True, exist_ok=True)
        for path in sorted(source.glob("*.py")):
            out = dest / path.name
            shutil.copyfile(path.resolve(), out)  # resolve: editable installs link files
            written.append(out)
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
