"""A package docstring names all of its modules or none of them: a partial list
reads as complete and goes stale as modules are added."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = [
    "src/kvstrata",
    "src/kvstrata/testing",
    "src/kvstrata/refdocs",
    "sidecar",
    "sidecar/tiers",
    "sidecar/transfer",
    "connector",
    "bench",
]
# A module is named as :mod:`.name`, :mod:`kvstrata.package.name` or ``name``.
_MOD = re.compile(r":mod:`(?:[\w.]*\.)?(\w+)`")
_LITERAL = re.compile(r"``(\w+)``")


def modules(package: Path) -> set[str]:
    names = {p.stem for p in package.glob("*.py") if not p.name.startswith("__")}
    names |= {p.name for p in package.iterdir() if (p / "__init__.py").exists()}
    return names


def named(docstring: str, candidates: set[str]) -> set[str]:
    found = set(_MOD.findall(docstring)) | set(_LITERAL.findall(docstring))
    return found & candidates


@pytest.mark.parametrize("package", PACKAGES)
def test_a_package_docstring_names_every_module_or_none(package: str) -> None:
    path = REPO / package
    docstring = ast.get_docstring(ast.parse((path / "__init__.py").read_text())) or ""
    assert docstring, f"{package}/__init__.py has no docstring"
    all_modules = modules(path)
    mentioned = named(docstring, all_modules)
    assert mentioned in (set(), all_modules), (
        f"{package}/__init__.py names {sorted(mentioned)} but not "
        f"{sorted(all_modules - mentioned)}: name all of them or none"
    )


def test_the_check_sees_a_partial_list() -> None:
    assert named("see :mod:`.plan` and ``kernels``", {"plan", "kernels", "abi"}) == {
        "plan",
        "kernels",
    }
