"""The ``kvstrata`` command line.

Each subcommand lives in its own module, which exposes two functions:

* ``add_arguments(parser: argparse.ArgumentParser) -> None``
* ``run(args: argparse.Namespace) -> int`` (the exit code)

Subcommand modules keep their top-level imports light (no torch, vLLM or
kopf) so that ``kvstrata --help`` answers at once; heavy imports happen in
``run``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "sidecar": ("kvstrata.sidecar.main", "run the cache sidecar (engine, tiers, ZMQ + HTTP)"),
    "operator": ("kvstrata.operator.main", "run the kopf operator and admission webhook"),
    "demo": ("kvstrata.demo", "run vLLM-CPU with a local sidecar on a shared-prefix workload"),
    "bench": ("kvstrata.bench.main", "run a benchmark and print its figures (--json)"),
    "selftest": ("kvstrata.testing.selftest", "check the GPU path on this node (selftest gpu)"),
}


def build_parser() -> argparse.ArgumentParser:
    from kvstrata import __version__

    parser = argparse.ArgumentParser(
        prog="kvstrata",
        description="Kubernetes-native, tiered KV cache for vLLM.",
    )
    parser.add_argument("--version", action="version", version=f"kvstrata {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        module = importlib.import_module(module_name)
        module.add_arguments(sub_parser)
        sub_parser.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return int(args._module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
