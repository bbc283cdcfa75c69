"""The Makefile as a newcomer meets it: an old Python refused up front, and
``make help`` naming only targets that exist."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MAKEFILE = REPO / "Makefile"

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")


def make(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["make", "--no-print-directory", "-f", str(MAKEFILE), *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=120,
    )


@pytest.fixture
def python310(tmp_path: Path) -> Path:
    """A stand-in for a Python 3.10 interpreter (no such one is installed here):
    answers ``-V`` as 3.10 does and fails a version check as 3.10 would."""
    fake = tmp_path / "python3.10"
    fake.write_text('#!/bin/sh\ncase "$1" in -V) echo "Python 3.10.12";; -c) exit 1;; esac\n')
    fake.chmod(0o755)
    return fake


@pytest.mark.parametrize("target", ["demo", "test", "test-fast", "venv", "system-deps"])
def test_python_older_than_3_11_is_refused_in_one_sentence_before_any_install(
    target: str, python310: Path, tmp_path: Path
) -> None:
    done = make(target, f"PYTHON={python310}", f"VENV={tmp_path / 'venv'}")
    assert done.returncode != 0
    said = done.stdout + done.stderr
    first = said.strip().splitlines()[0]
    assert first.startswith("kvstrata needs Python 3.11 or newer")
    assert "Python 3.10.12" in first
    assert "apt-get" not in said and "pip" not in said
    assert not (tmp_path / "venv").exists()


def test_the_project_says_it_needs_python_3_11():
    text = (REPO / "pyproject.toml").read_text()
    assert 'requires-python = ">=3.11"' in text


def test_every_target_make_help_names_exists():
    shown = make("help").stdout
    named = set(re.findall(r"make ([a-z][a-z-]*)", shown))
    assert {"demo", "test", "test-fast", "bench", "bench-serve", "bench-soak"} <= named
    for target in named:
        assert make("-n", target).returncode == 0, target


def test_make_demo_installs_only_what_the_demo_starts():
    planned = make("-n", "demo").stdout
    (loop,) = [line for line in planned.splitlines() if "for p in" in line]
    assert loop.split("for p in")[1].split(";")[0].split() == ["redis-server"]
