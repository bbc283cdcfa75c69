"""Every runtime module fits in :data:`MAX_LINES` lines.

Why: a module that grows past that holds more than one job, and the next
change to either job has to read both; one responsibility per module, named
by its docstring, is what keeps the runtime readable (see the size rules in
the project's style notes, and tests/unit/test_function_sizes.py for the
functions). The runtime modules are every module of the installed package
(``src/kvstrata``, through its sidecar/, connector/ and operator/ links)
except the test harnesses (``kvstrata.testing``) and the benchmarks
(``kvstrata.bench``). :data:`ALLOWED` holds the modules still to be split,
each with the reason; it may only shrink: an entry whose module fits (or is
gone) fails here until it is removed.
"""

from __future__ import annotations

from pathlib import Path

from kvstrata.refdocs import REPO

MAX_LINES = 500
PACKAGE = REPO / "src" / "kvstrata"
# Not runtime: the test harnesses and the benchmarks ship in the package but
# never run in a sidecar, a vLLM process or the operator.
NOT_RUNTIME = frozenset({"testing", "bench"})

# module (from the repository root) -> why it is still longer.
ALLOWED: dict[str, str] = {}


def runtime_modules(package: Path = PACKAGE) -> list[Path]:
    """Every ``.py`` file of the runtime packages, with the package's links followed."""
    out: list[Path] = []
    for entry in sorted(package.iterdir()):
        if entry.name in NOT_RUNTIME or entry.name == "__pycache__":
            continue
        if entry.is_dir():
            out += sorted(entry.resolve().rglob("*.py"))
        elif entry.suffix == ".py":
            out.append(entry.resolve())
    return [path for path in out if "__pycache__" not in path.parts]


def line_count(source: str) -> int:
    """Lines as an editor numbers them (a last line without a newline counts)."""
    return len(source.splitlines())


def module_sizes(package: Path = PACKAGE) -> dict[str, int]:
    """``{module path from the repository root: lines}`` of every runtime module."""
    return {
        path.relative_to(REPO).as_posix(): line_count(path.read_text())
        for path in runtime_modules(package)
    }


def test_the_measure_counts_lines_with_or_without_a_last_newline() -> None:
    assert line_count("a = 1\nb = 2\n") == 2
    assert line_count("a = 1\nb = 2") == 2
    assert line_count("") == 0


def test_the_runtime_modules_are_the_package_through_its_links_less_tests_and_benchmarks() -> None:
    modules = module_sizes()
    for expected in (
        "src/kvstrata/cli.py",
        "src/kvstrata/refdocs/architecture.py",
        "sidecar/engine.py",
        "sidecar/tiers/s3.py",
        "sidecar/transfer/ipc.py",
        "connector/client.py",
        "operator/reconcile.py",
    ):
        assert expected in modules, expected
    assert not any(m.startswith(("src/kvstrata/testing/", "bench/")) for m in modules)


def test_every_runtime_module_fits_in_five_hundred_lines() -> None:
    too_long = {m: n for m, n in module_sizes().items() if n > MAX_LINES and m not in ALLOWED}
    assert too_long == {}, (
        f"split these by responsibility (at most {MAX_LINES} lines each): "
        + ", ".join(f"{m} ({n} lines)" for m, n in sorted(too_long.items()))
    )


def test_the_allow_list_only_shrinks() -> None:
    """An allowed module that now fits (or is gone) is taken off the list."""
    sizes = module_sizes()
    fitted = [m for m in ALLOWED if sizes.get(m, 0) <= MAX_LINES]
    assert fitted == [], f"these fit in {MAX_LINES} lines now: remove them from ALLOWED"
