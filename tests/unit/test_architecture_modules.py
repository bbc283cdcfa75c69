"""``docs/architecture.md``'s module table follows the code: a module added or a
summary changed makes the committed page stale (test_reference_docs.py then
fails on it), and the table is the only part of that page rendered."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstrata.refdocs import PAGES, REPO, architecture


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A repository with the real page and one module in each runtime folder."""
    (tmp_path / "docs").mkdir()
    (tmp_path / architecture.PAGE).write_text((REPO / architecture.PAGE).read_text())
    for subsystem in architecture.RUNTIME:
        folder = tmp_path / subsystem.folder
        folder.mkdir(parents=True)
        (folder / "__init__.py").write_text('"""A package: not a row of its own."""\n')
        (folder / "one.py").write_text('"""Why one exists.\n\nMore about it."""\n')
    return tmp_path


def test_the_page_is_one_of_the_generated_references() -> None:
    assert PAGES[architecture.PAGE] is architecture.render


def test_each_module_is_a_row_with_its_subsystem_and_first_paragraph(repo: Path) -> None:
    page = architecture.render(repo)
    assert "| `connector/one.py` | connector (in vLLM) | Why one exists. |" in page
    assert "__init__" not in page.split(architecture.BEGIN)[1].split(architecture.END)[0]
    assert "More about it" not in page


def test_an_added_module_makes_the_committed_table_stale(repo: Path) -> None:
    before = architecture.render(repo)
    (repo / architecture.PAGE).write_text(before)
    assert architecture.render(repo) == before  # rendering the rendered page changes nothing
    (repo / "sidecar/tiers/two.py").write_text('"""A new tier: :class:`~a.b.Two` of ``two``."""\n')
    after = architecture.render(repo)
    assert after != before
    assert "| `sidecar/tiers/two.py` | sidecar: tiers below L1 | A new tier: `Two` of `two`. |" in (
        after
    )


def test_the_hand_written_rest_of_the_page_is_kept(repo: Path) -> None:
    page = (repo / architecture.PAGE).read_text()
    edited = page.replace("## In brief", "## In short", 1)
    assert edited != page
    (repo / architecture.PAGE).write_text(edited)
    assert "## In short" in architecture.render(repo)


def test_a_runtime_module_without_a_docstring_is_refused_by_name(repo: Path) -> None:
    (repo / "operator/bare.py").write_text("X = 1\n")
    with pytest.raises(ValueError, match=r"operator/bare\.py"):
        architecture.render(repo)


def test_a_page_that_lost_its_markers_is_refused(repo: Path) -> None:
    page = (repo / architecture.PAGE).read_text()
    (repo / architecture.PAGE).write_text(page.replace(architecture.END, ""))
    with pytest.raises(ValueError, match="markers"):
        architecture.render(repo)
