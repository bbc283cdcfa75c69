"""``docs/architecture.md``'s module table: every runtime module and what it is for.

The page is written by hand except for the part between :data:`BEGIN` and
:data:`END`, which is rendered from the code: one row per module of the
runtime packages (:data:`RUNTIME`), with its subsystem and its docstring's
first paragraph (each module's docstring says why it exists). A module
added, removed, moved or given a new summary makes the committed page
stale. Line counts are left out on purpose: any edit anywhere would make
the page stale, and the size rules are kept by tests instead
(tests/unit/test_module_sizes.py, tests/unit/test_function_sizes.py).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

from kvstrata.refdocs.markdown import GENERATED, table

PAGE = "docs/architecture.md"
BEGIN = "<!-- generated: modules (make docs) -->"
END = "<!-- end of generated modules -->"
# A Sphinx cross-reference (:mod:`.protocol`, :class:`~a.b.Name`): Markdown
# shows its target, with "~" as Sphinx does (the last name only).
_ROLE = re.compile(r":\w+:`(~?)\.?([\w.]+)`")


@dataclass(frozen=True, slots=True)
class Subsystem:
    """One runtime package: its folder (from the repository root) and its name on the page."""

    folder: str
    name: str


# The packages that run in production: the sidecar, the connector inside
# vLLM, the operator and the command line. Benchmarks (bench/), test
# harnesses (kvstrata.testing) and these page renderers are not listed.
RUNTIME: tuple[Subsystem, ...] = (
    Subsystem("sidecar", "sidecar"),
    Subsystem("sidecar/tiers", "sidecar: tiers below L1"),
    Subsystem("sidecar/transfer", "sidecar: transfer path"),
    Subsystem("connector", "connector (in vLLM)"),
    Subsystem("operator", "operator"),
    Subsystem("src/kvstrata", "command line"),
)


def runtime_modules(repo: Path) -> list[tuple[Subsystem, Path]]:
    """Every runtime module (package ``__init__``/``__main__`` files aside), in page order."""
    out = []
    for subsystem in RUNTIME:
        folder = repo / subsystem.folder
        if not folder.is_dir():
            raise FileNotFoundError(f"{folder}: a runtime package folder is missing")
        for path in sorted(folder.glob("*.py")):
            if not path.name.startswith("__"):
                out.append((subsystem, path))
    return out


def summary(path: Path) -> str:
    """The first paragraph of the module's docstring, on one line."""
    doc = ast.get_docstring(ast.parse(path.read_text(), filename=str(path)))
    if not doc:
        raise ValueError(f"{path}: a runtime module without a docstring (say why it exists)")
    text = " ".join(doc.split("\n\n")[0].split())
    text = _ROLE.sub(lambda m: f"`{m[2].rsplit('.', 1)[-1] if m[1] else m[2]}`", text)
    return text.replace("``", "`")


def section(repo: Path) -> list[str]:
    rows = [
        (f"`{path.relative_to(repo).as_posix()}`", subsystem.name, summary(path))
        for subsystem, path in runtime_modules(repo)
    ]
    source = "each runtime module's docstring (`kvstrata.refdocs.architecture`)"
    return [
        BEGIN,
        "",
        GENERATED.format(source=source),
        "",
        *table(("module", "subsystem", "what it is for"), rows),
        "",
        END,
    ]


def render(repo: Path) -> str:
    """The committed page with its module table rendered afresh."""
    page = (repo / PAGE).read_text()
    head, begin, rest = page.partition(BEGIN)
    _old, end, tail = rest.partition(END)
    if not (begin and end):
        raise ValueError(f"{PAGE} has lost its markers {BEGIN!r} ... {END!r}")
    return head + "\n".join(section(repo)) + tail
