"""Build the container images with ``make images`` and run them, on this machine.

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
* ``buildah run`` starts the images' commands on the host's network, with
  the directories a test shares bind-mounted at the same path.

These tests never skip: without root, buildah or mmdebstrap they fail and
say how to get them (``make image-deps``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvstrata.testing.poll import wait_until
from kvstrata.testing.sidecarproc import SidecarProcess

REPO = Path(__file__).resolve().parents[2]
WORK = REPO / "build" / "images"
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


class Buildah:
    """``buildah`` on the suite's own storage (``CONTAINERS_STORAGE_CONF``)."""

    def __init__(self, work: Path) -> None:
        work.mkdir(parents=True, exist_ok=True)
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
            raise AssertionError(f"buildah {' '.join(args)}: {result.returncode}\n{result.stderr}")
        return result

    def has_image(self, ref: str) -> bool:
        return self("images", "--quiet", ref, check=False).returncode == 0

    def config(self, ref: str) -> dict[str, Any]:
        """The image's OCI config (User, Entrypoint, Cmd, Env ...) plus Docker's Healthcheck."""
        inspected = json.loads(self("inspect", "--type", "image", ref).stdout)
        config = dict(inspected["OCIv1"]["config"])
        config["Healthcheck"] = (inspected.get("Docker") or {}).get("config", {}).get("Healthcheck")
        return config

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


def _require_tools() -> None:
    """Fail (never skip) without what the build needs."""
    if os.geteuid() != 0:
        pytest.fail("the image tests build with buildah as root; run them as root")
    missing = [tool for tool in ("buildah", "mmdebstrap") if shutil.which(tool) is None]
    if missing:
        pytest.fail(f"{' and '.join(missing)} not on PATH: run `make image-deps`")


def _require_disk(work: Path) -> None:
    """Fail before the build, naming the free space, rather than midway
    with buildah's "no space left on device"."""
    free = shutil.disk_usage(work).free
    if free < BUILD_FREE_BYTES:
        pytest.fail(
            f"the image build needs {BUILD_FREE_BYTES / 2**30:.0f} GiB free under {work} "
            f"(vfs storage copies every layer), and {free / 2**30:.1f} GiB is free"
        )


@pytest.fixture(scope="session")
def buildah() -> Buildah:
    _require_tools()
    return Buildah(WORK)


def _build_base(buildah: Buildah) -> str:
    """``localhost/kvstrata-test-base:<hash>``: Debian + python3, made here once."""
    recipe = json.dumps([SUITE, MIRROR, BASE_PACKAGES, "minbase"])
    ref = f"localhost/kvstrata-test-base:{hashlib.sha256(recipe.encode()).hexdigest()[:12]}"
    if buildah.has_image(ref):
        return ref
    with tempfile.TemporaryDirectory(dir=WORK) as tmp:
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


@pytest.fixture(scope="session")
def images(buildah: Buildah) -> SimpleNamespace:
    """The three targets, built by ``make images`` on the local base; the
    refs by target, the base and how long each step took (printed)."""
    _require_disk(WORK)
    started = time.monotonic()
    base = _build_base(buildah)
    base_s = time.monotonic() - started
    bases = ("PYTHON_BASE", "CUDA_DEVEL_BASE", "CUDA_RUNTIME_BASE")
    args = " ".join(["--pull-never", *(f"--build-arg={arg}={base}" for arg in bases)])
    started = time.monotonic()
    result = subprocess.run(
        [
            "make",
            "--no-print-directory",
            "-C",
            str(REPO),
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
    (WORK / "make-images.log").write_text(result.stdout + result.stderr)
    if result.returncode != 0:
        pytest.fail(f"make images failed ({result.returncode}):\n{result.stderr[-6000:]}")
    # The images of earlier runs, untagged by this one, would pile up.
    buildah("rmi", "--prune", check=False)
    refs = {target: f"{REGISTRY}/kvstrata-{target}:{TAG}" for target in TARGETS}
    print(f"\nimage base {base_s:.0f} s, make images {build_s:.0f} s", file=sys.stderr)
    return SimpleNamespace(refs=refs, base=base, base_s=base_s, build_s=build_s)


@pytest.fixture(scope="session")
def containers(buildah: Buildah, images: SimpleNamespace) -> Iterator[dict[str, str]]:
    """One working container per image, shared by the tests: with vfs each one
    is a full copy of the image, and the tests write only into mounted dirs."""
    with contextlib.ExitStack() as stack:
        yield {
            target: stack.enter_context(buildah.container(ref))
            for target, ref in images.refs.items()
        }


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory the image's user (65532) and this process both write.

    Not under pytest's tmp_path: its parents are private to root, and the
    bind mount needs only this one directory to be open."""
    root = Path(tempfile.mkdtemp(prefix="kvstrata-image-"))
    root.chmod(0o777)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            found += [int(c) for c in (task / "children").read_text().split()]
    return found


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (through ``/proc/PID/task/*/children``)."""
    out, todo = [], [pid]
    while todo:
        for child in _children(todo.pop()):
            out.append(child)
            todo.append(child)
    return out


class ImageSidecar(SidecarProcess):
    """``kvstrata sidecar`` inside an image, through ``buildah run``.

    Its socket, config and L2 live in a directory mounted at the same path,
    and ``/dev/shm`` is the host's, so a client here maps the same arena.
    ``buildah run`` answers SIGTERM by killing what it runs, so :meth:`stop`
    signals the sidecar process itself, as the kubelet signals a container.
    """

    error = AssertionError
    start_timeout_s = 60.0
    stop_timeout_s = 20.0

    def __init__(
        self,
        root: Path,
        buildah: Buildah,
        container: str,
        chunk_size: int = 16,
        l1_size: str = "16Mi",
    ) -> None:
        super().__init__(
            root, chunk_size=chunk_size, l1_size=l1_size, l2_size="64Mi", log_level="INFO"
        )
        self.buildah = buildah
        self.container = container
        root.chmod(0o777)  # the image's user writes its socket and L2 here
        self.extra_env = {k: buildah.env[k] for k in STORAGE_ENV}

    def command(self) -> list[str]:
        return self.buildah.run_argv(
            self.container, ["kvstrata", "sidecar"], mounts=[self.root, Path("/dev/shm")]
        )

    def sidecar_pid(self) -> int:
        """The pid of the ``kvstrata sidecar`` Python process under ``buildah run``."""
        assert self.proc is not None

        def find() -> int | None:
            for pid in descendants(self.proc.pid):
                with contextlib.suppress(OSError):
                    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                    if b"python" in argv[0] and b"sidecar" in argv:
                        return pid
            return None

        return int(wait_until(find, 10, "the sidecar process under buildah run"))

    def stop(self) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        os.kill(self.sidecar_pid(), signal.SIGTERM)
        try:
            return self.proc.wait(timeout=self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"sidecar ignored SIGTERM: {self.log()}") from None
