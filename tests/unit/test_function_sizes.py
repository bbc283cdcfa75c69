"""Every runtime function fits on a screen: at most :data:`MAX_LINES` lines,
from its ``def`` to its last line (docstring and comments included).

Why: a function that grows past a screen mixes steps that each deserve a
name; splitting it into named steps is what keeps the modules readable (see
the size rules in the project's style notes). The runtime modules are those
of ``docs/architecture.md``'s module table (:data:`kvstrata.refdocs.architecture.RUNTIME`).
:data:`ALLOWED` holds the functions still to be split, each with the reason;
it may only shrink: an entry whose function was split fails here until it
is removed.
"""

from __future__ import annotations

import ast

from kvstrata.refdocs import REPO
from kvstrata.refdocs.architecture import runtime_modules

MAX_LINES = 60

# (module, qualified name) -> why it is still longer.
ALLOWED: dict[tuple[str, str], str] = {}


def long_functions(source: str, limit: int = MAX_LINES) -> dict[str, int]:
    """``{qualified name: lines}`` of the functions in ``source`` longer than ``limit``."""
    found: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    lines = (child.end_lineno or child.lineno) - child.lineno + 1
                    if lines > limit:
                        found[name] = lines
                visit(child, f"{name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def _all_long_functions() -> dict[tuple[str, str], int]:
    out = {}
    for _subsystem, path in runtime_modules(REPO):
        module = path.relative_to(REPO).as_posix()
        for name, lines in long_functions(path.read_text()).items():
            out[(module, name)] = lines
    return out


def test_the_measure_counts_from_def_to_the_last_line_and_names_methods() -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(59))
    method_body = "\n".join(f"        x{i} = {i}" for i in range(59))
    source = (
        f"def fits():\n{body}\n"  # 60 lines
        f"class C:\n    def grows(self):\n{method_body}\n        y = 1\n"
        "        def inner():\n            pass\n"
    )
    assert long_functions(source) == {"C.grows": 63}


def test_every_runtime_function_fits_in_sixty_lines() -> None:
    too_long = {key: n for key, n in _all_long_functions().items() if key not in ALLOWED}
    assert too_long == {}, (
        f"split these into named steps (at most {MAX_LINES} lines each): "
        + ", ".join(f"{m}:{name} ({n} lines)" for (m, name), n in sorted(too_long.items()))
    )


def test_the_allow_list_only_shrinks() -> None:
    """An allowed function that now fits (or is gone) is taken off the list."""
    long_now = _all_long_functions()
    fitted = [f"{m}:{name}" for m, name in ALLOWED if (m, name) not in long_now]
    assert fitted == [], f"these fit in {MAX_LINES} lines now: remove them from ALLOWED"
