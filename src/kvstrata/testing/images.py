"""The project's container images, built here by ``make images`` with buildah, for the
suites that run them: the image tests (``tests/images``) and the node scenario of the
k8s suite, which imports them into its node's containerd.

No Docker engine runs here and no registry is reachable, so:

* the bases come from Debian packages: ``mmdebstrap`` makes a bookworm root
  filesystem with ``python3`` (what the slim Python base gives the Dockerfile),
  imported as ``localhost/kvstrata-test-base:<hash of its recipe>``; the
  Dockerfile's base build arguments all point at it (the CUDA targets too: the
  GPU sidecar's build then finds no nvcc and is the host-mode sidecar on that base);
* ``buildah`` builds, as root, with ``--isolation chroot`` and the ``vfs``
  driver (no runc, no overlayfs needed), into a storage of its own under
  ``build/images/`` (kept between runs: the base and the layer cache make a
  second run fast; ``make clean`` removes it);
* :meth:`Buildah.archive` writes an image as a Docker archive, the form
  ``ctr images import`` loads into a node.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUITE = "bookworm"
MIRROR = "http://deb.debian.org/debian"
BASE_PACKAGES = ("python3", "python3-venv")
REGISTRY = "localhost/kvstrata-test"
TAG = "test"
TARGETS = ("operator", "sidecar", "sidecar-cuda")
BUILD_TIMEOUT_S = 1200
# vfs copies every layer whole: the three builds and the tests' containers
# peaked at 3.1 GB under build/images (sampled every 10 s, 2026-11-27).
BUILD_FREE_BYTES = 4 << 30
STORAGE_ENV = ("CONTAINERS_STORAGE_CONF", "STORAGE_DRIVER", "BUILDAH_ISOLATION")


class ImageBuildError(RuntimeError):
    """The images cannot be built or exported here: the message says what failed."""


def missing_build_tools() -> str | None:
    """Why this machine cannot build the images (root, buildah, mmdebstrap); None when it can."""
    if os.geteuid() != 0:
        return "the images are built with buildah as root; run as root"
    missing = [tool for tool in ("buildah", "mmdebstrap") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not on PATH: run `make image-deps`"
    return None


class Buildah:
    """``buildah`` on the suite's own storage (``CONTAINERS_STORAGE_CONF``)."""

    def __init__(self, work: Path) -> None:
        work.mkdir(parents=True, exist_ok=True)
        self.work = work
        conf = work / "storage.conf"
        conf.write_text(
            "[storage]\n"
            'driver = "vfs"\n'
            f'graphroot = "{work / "storage"}"\n'
            f'runroot = "{work / "run"}"\n'
        )
        storage = dict(zip(STORAGE_ENV, (str(conf), "vfs", "chroot"), strict=True))
        self.env = {**os.environ, **storage}

    def __call__(
        self, *args: str, timeout: float = 120, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            ["buildah", *args], env=self.env, capture_output=True, text=True, timeout=timeout
        )
        if check and result.returncode != 0:
            raise ImageBuildError(f"buildah {' '.join(args)}: {result.returncode}\n{result.stderr}")
        return result

    def has_image(self, ref: str) -> bool:
        return self("images", "--quiet", ref, check=False).returncode == 0

    def config(self, ref: str) -> dict[str, Any]:
        """The image's OCI config (User, Entrypoint, Cmd, Env ...) plus Docker's Healthcheck."""
        inspected = json.loads(self("inspect", "--type", "image", ref).stdout)
        config = dict(inspected["OCIv1"]["config"])
        config["Healthcheck"] = (inspected.get("Docker") or {}).get("config", {}).get("Healthcheck")
        return config

    def archive(self, ref: str, path: Path) -> Path:
        """``ref`` as a Docker archive at ``path``, tagged ``ref`` (what ``ctr`` imports)."""
        path.unlink(missing_ok=True)  # buildah refuses to overwrite an archive
        self("push", "--quiet", ref, f"docker-archive:{path}:{ref}", timeout=600)
        return path

    @contextlib.contextmanager
    def container(self, ref: str) -> Iterator[str]:
        """A working container of ``ref``; removed afterwards."""
        name = self("from", "--pull-never", ref).stdout.strip()
        try:
            yield name
        finally:
            self("rm", name, check=False)

    def run_argv(
        self, container: str, argv: Sequence[str], mounts: Sequence[Path] = ()
    ) -> list[str]:
        """``buildah run`` of ``argv`` as the image's user, each mount at its own path."""
        volumes = [f"--volume={m}:{m}" for m in mounts]
        return ["buildah", "run", "--isolation=chroot", *volumes, container, "--", *argv]

    def run(
        self, container: str, argv: Sequence[str], mounts: Sequence[Path] = (), timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.run_argv(container, argv, mounts),
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )


def build_base(buildah: Buildah) -> str:
    """``localhost/kvstrata-test-base:<hash>``: Debian + python3, made here once."""
    recipe = json.dumps([SUITE, MIRROR, BASE_PACKAGES, "minbase"])
    ref = f"localhost/kvstrata-test-base:{hashlib.sha256(recipe.encode()).hexdigest()[:12]}"
    if buildah.has_image(ref):
        return ref
    with tempfile.TemporaryDirectory(dir=buildah.work) as tmp:
        rootfs = Path(tmp) / "rootfs.tar"
        subprocess.run(
            [
                "mmdebstrap",
                "--quiet",
                "--mode=root",
                "--variant=minbase",
                f"--include={','.join(BASE_PACKAGES)}",
                # Documentation and translations: not needed to run Python.
                "--dpkgopt=path-exclude=/usr/share/doc/*",
                "--dpkgopt=path-exclude=/usr/share/man/*",
                "--dpkgopt=path-exclude=/usr/share/locale/*",
                SUITE,
                str(rootfs),
                MIRROR,
            ],
            check=True,
            capture_output=True,
            timeout=900,
        )
        container = buildah("from", "scratch").stdout.strip()
        try:
            buildah("add", container, str(rootfs), "/", timeout=300)
            buildah(
                "config",
                "--env=PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                "--cmd=/bin/sh",
                container,
            )
            buildah("commit", "--quiet", container, ref, timeout=300)
        finally:
            buildah("rm", container, check=False)
    return ref


@dataclass(frozen=True, slots=True)
class BuiltImages:
    """The refs by target, the base, and how long each step took."""

    refs: dict[str, str]
    base: str
    base_s: float
    build_s: float


def build_images(buildah: Buildah, repo: Path) -> BuiltImages:
    """The three targets, built by ``make images`` in ``repo`` on the local base."""
    # Refused before the build, naming the free space, rather than midway
    # with buildah's "no space left on device".
    free = shutil.disk_usage(buildah.work).free
    if free < BUILD_FREE_BYTES:
        raise ImageBuildError(
            f"the image build needs {BUILD_FREE_BYTES / 2**30:.0f} GiB free under {buildah.work} "
            f"(vfs storage copies every layer), and {free / 2**30:.1f} GiB is free"
        )
    started = time.monotonic()
    base = build_base(buildah)
    base_s = time.monotonic() - started
    bases = ("PYTHON_BASE", "CUDA_DEVEL_BASE", "CUDA_RUNTIME_BASE")
    args = " ".join(["--pull-never", *(f"--build-arg={arg}={base}" for arg in bases)])
    started = time.monotonic()
    result = subprocess.run(
        [
            "make",
            "--no-print-directory",
            "-C",
            str(repo),
            "images",
            f"REGISTRY={REGISTRY}",
            f"IMAGE_TAG={TAG}",
            f"IMAGE_BUILD_ARGS={args}",
        ],
        env=buildah.env,
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
    )
    build_s = time.monotonic() - started
    (buildah.work / "make-images.log").write_text(result.stdout + result.stderr)
    if result.returncode != 0:
        raise ImageBuildError(f"make images failed ({result.returncode}):\n{result.stderr[-6000:]}")
    # The images of earlier runs, untagged by this one, would pile up.
    buildah("rmi", "--prune", check=False)
    refs = {target: f"{REGISTRY}/kvstrata-{target}:{TAG}" for target in TARGETS}
    return BuiltImages(refs=refs, base=base, base_s=base_s, build_s=build_s)
