"""Build the container images with ``make images`` and run them, on this machine.

* the build (a Debian base made with ``mmdebstrap``, ``buildah`` as root on a
  ``vfs`` storage of its own under ``build/images/``) is
  :mod:`kvstrata.testing.images`, shared with the k8s suite's node scenario;
* ``buildah run`` starts the images' commands on the host's network, with
  the directories a test shares bind-mounted at the same path.

These tests never skip: without root, buildah or mmdebstrap they fail and
say how to get them (``make image-deps``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstrata.testing.images import (
    STORAGE_ENV,
    Buildah,
    BuiltImages,
    ImageBuildError,
    build_images,
    missing_build_tools,
)
from kvstrata.testing.poll import wait_until
from kvstrata.testing.sidecarproc import SidecarProcess

REPO = Path(__file__).resolve().parents[2]
WORK = REPO / "build" / "images"


@pytest.fixture(scope="session")
def buildah() -> Buildah:
    """Fail (never skip) without what the build needs."""
    missing = missing_build_tools()
    if missing:
        pytest.fail(missing)
    return Buildah(WORK)


@pytest.fixture(scope="session")
def kit() -> types.ModuleType:
    """This module (``kit.ImageSidecar``): test modules cannot import a
    conftest under ``--import-mode=importlib``."""
    return sys.modules[__name__]


@pytest.fixture(scope="session")
def images(buildah: Buildah) -> BuiltImages:
    """The three targets, built by ``make images`` on the local base (times printed)."""
    try:
        built = build_images(buildah, REPO)
    except ImageBuildError as exc:
        pytest.fail(str(exc))
    print(f"\nimage base {built.base_s:.0f} s, make images {built.build_s:.0f} s", file=sys.stderr)
    return built


@pytest.fixture(scope="session")
def containers(buildah: Buildah, images: BuiltImages) -> Iterator[dict[str, str]]:
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
