"""No runtime code compares a transfer mode or a load_async setting as a string: an AST scan.

Why: the mode is parsed once, at the config, extra-config and protocol
boundaries, into :mod:`kvstrata.sidecar.transfer_mode`'s enums, and the
connector's ``load_async`` key once, in :mod:`kvstrata.connector.settings`,
into :class:`~kvstrata.connector.settings.LoadAsync`. A bare
``mode == "ipc"`` past that point compares a member with a string and is
always false, silently: the worker would never ask for ipc, the sidecar
never grant it, a scheduler told ``always`` would load inline. So every
comparison (``==``, ``!=``, ``in``, ``is``, a ``match`` case) with one of
those names as a literal fails here, unless it is listed in
:data:`ALLOWED` with what the literal means instead.
"""

from __future__ import annotations

import ast
from pathlib import Path

from kvstrata.connector.settings import LoadAsync
from kvstrata.sidecar.transfer_mode import ModeSetting, TransferMode

REPO = Path(__file__).resolve().parents[2]
# The folders of the kvstrata package (sidecar/, connector/, operator/ and
# bench/ are linked into src/kvstrata; scanned where they live).
SOURCES = ["src/kvstrata", "sidecar", "connector", "operator", "bench"]
PARSER = "sidecar/transfer_mode.py"  # where the mode strings are read, once
MODE_NAMES = frozenset(m.value for enum in (TransferMode, ModeSetting, LoadAsync) for m in enum)

# (file, the expression compared with the literal) -> what the literal means
# there. The same words name other things; each entry says which.
ALLOWED: dict[tuple[str, str], str] = {
    ("sidecar/endpoint.py", "scheme"): "the endpoint URL's scheme, ipc:// or tcp://",
    ("sidecar/transfer/csrc_build.py", "library.kind"): "the csrc library built for the CPU",
    ("connector/settings.py", "cache_dtype"): "vLLM's cache_dtype, auto meaning the model's",
    ("bench/transfer.py", "paths"): "the copy paths `kvstrata bench transfer` measures, by name",
}


def _mode_literals(node: ast.AST) -> set[str]:
    """Mode names written as literals in ``node`` (a constant, or one in a tuple, list or set)."""
    items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return {
        item.value
        for item in items
        if isinstance(item, ast.Constant) and isinstance(item.value, str)
        if item.value in MODE_NAMES
    }


def mode_compares(source: str) -> list[tuple[int, str, str]]:
    """``(line, literal, what it is compared with)`` for each comparison of a mode name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            for i, operand in enumerate(operands):
                others = [ast.unparse(o) for j, o in enumerate(operands) if j != i]
                found += [(node.lineno, lit, " ".join(others)) for lit in _mode_literals(operand)]
        elif isinstance(node, ast.Match):
            subject = ast.unparse(node.subject)
            for case in node.cases:
                for pattern in ast.walk(case.pattern):
                    if isinstance(pattern, ast.MatchValue):
                        found += [
                            (pattern.lineno, lit, subject) for lit in _mode_literals(pattern.value)
                        ]
    return sorted(found)


def _modules() -> list[str]:
    out = []
    for top in SOURCES:
        for path in (REPO / top).rglob("*.py"):
            if path.is_file() and not path.is_symlink():
                out.append(str(path.relative_to(REPO)))
    return sorted(set(out) - {PARSER})


def test_the_scan_covers_the_runtime_packages() -> None:
    modules = _modules()
    for expected in ("connector/client.py", "sidecar/handlers.py", "operator/mutate.py"):
        assert expected in modules


def test_the_scan_finds_each_form_of_a_string_compare() -> None:
    source = (
        "if session.transfer_mode == 'ipc': pass\n"
        "ok = mode != 'host'\n"
        "served = 'ipc' in modes\n"
        "match config.transfer_mode:\n"
        "    case 'auto': pass\n"
        "also = kind in ('tcp', 'host')\n"
        "eager = settings.load_async != 'never'\n"
        "fine = mode is TransferMode.IPC\n"
    )
    assert mode_compares(source) == [
        (1, "ipc", "session.transfer_mode"),
        (2, "host", "mode"),
        (3, "ipc", "modes"),
        (5, "auto", "config.transfer_mode"),
        (6, "host", "kind"),
        (7, "never", "settings.load_async"),
    ]


def test_no_runtime_module_compares_a_transfer_mode_as_a_string() -> None:
    bad = [
        f"{module}:{line}: {expr} compared with {literal!r}"
        for module in _modules()
        for line, literal, expr in mode_compares((REPO / module).read_text())
        if (module, expr) not in ALLOWED
    ]
    assert bad == [], (
        "compare TransferMode / ModeSetting members (parsed once, in "
        f"kvstrata.sidecar.transfer_mode), not strings: {bad}"
    )


def test_every_allowed_compare_still_exists() -> None:
    """An entry whose compare went away is dropped, so the list only shrinks."""
    for module, expr in ALLOWED:
        assert any(e == expr for _line, _lit, e in mode_compares((REPO / module).read_text())), (
            f"{module}: no mode-name literal is compared with {expr} any more: drop it from ALLOWED"
        )
