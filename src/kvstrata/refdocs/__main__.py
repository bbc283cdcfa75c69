"""``python -m kvstrata.refdocs [REPO]``: write every page of :data:`PAGES`
under REPO (default: the current directory)."""

from __future__ import annotations

import sys
from pathlib import Path

from kvstrata.refdocs import PAGES


def main(argv: list[str]) -> None:
    repo = Path(argv[0]) if argv else Path.cwd()
    for page, render in PAGES.items():
        (repo / page).write_text(render(repo))
        print(f"wrote {page}")


if __name__ == "__main__":
    main(sys.argv[1:])
