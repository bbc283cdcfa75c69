"""The sidecar-cuda image's CUDA requirement, read from the Dockerfile.

The NVIDIA container runtime refuses to start a container whose
``NVIDIA_REQUIRE_CUDA`` the node's driver does not meet, unless
``NVIDIA_DISABLE_REQUIRE`` is true (nvidia-container-toolkit's documented
environment). The CUDA base image sets ``cuda>=12.8``; the sidecar-cuda
stage must not inherit a requirement that takes the Pod down on an older
driver the sidecar's static cudart runs on.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def stage_env(target: str) -> dict[str, str]:
    """The ENV a Dockerfile stage sets itself (line continuations joined)."""
    text = (REPO / "Dockerfile").read_text().replace("\\\n", " ")
    stages = re.split(r"^FROM ", text, flags=re.M)
    (stage,) = [s for s in stages if re.match(rf"\S+ AS {target}\s*$", s.splitlines()[0])]
    env: dict[str, str] = {}
    for line in stage.splitlines():
        if line.startswith("ENV "):
            for item in shlex.split(line[4:]):
                key, _, value = item.partition("=")
                env[key] = value
    return env


def test_the_cuda_sidecar_image_never_keeps_its_bases_cuda_12_8_requirement() -> None:
    env = stage_env("sidecar-cuda")
    assert env.get("NVIDIA_REQUIRE_CUDA") == "cuda>=12.0"
    assert env.get("NVIDIA_DISABLE_REQUIRE") == "true"
