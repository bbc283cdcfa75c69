"""The node's pause image, made here: one static binary that waits for a signal.

Why this module exists: every pod's sandbox runs the CRI's "pause" image, and
the node of the ``k8s`` suite reaches no registry. The binary is compiled
from the few lines below with the C compiler the project's own extension
build needs (``gcc -static``), and packed as a Docker image archive
(``manifest.json`` naming a config and one layer tar), the format
``ctr images import`` reads. The archive's shape::

    manifest.json   [{"Config": "<sha256>.json", "RepoTags": [REF], "Layers": ["layer.tar"]}]
    <sha256>.json   the image config: entrypoint /pause, the layer's diff id
    layer.tar       one file, /pause, mode 0755

The same archive serves as a stand-in main container: a pod that runs it
stays Running until it is deleted, and exits 0 on SIGTERM at once.
"""

from __future__ import annotations

import hashlib
import io
import json
import platform
import shutil
import subprocess
import tarfile
from pathlib import Path

REFERENCE = "localhost/kvstrata/pause:node"

# PID 1 of a pid namespace gets only the signals it handles: handle TERM and
# INT so that the kubelet's stop is immediate rather than a kill at the deadline.
SOURCE = r"""
#include <signal.h>
#include <unistd.h>
static void done(int sig) { (void)sig; _exit(0); }
int main(void) {
    signal(SIGTERM, done);
    signal(SIGINT, done);
    for (;;) pause();
}
"""

# platform.machine() to the OCI architecture names.
ARCHITECTURES = {"x86_64": "amd64", "aarch64": "arm64", "arm64": "arm64"}


class PauseImageError(RuntimeError):
    """The pause image cannot be built here: the message says what is missing."""


def compile_pause(workdir: Path) -> Path:
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise PauseImageError("no C compiler (gcc or cc) to build the node's pause binary")
    source, binary = workdir / "pause.c", workdir / "pause"
    source.write_text(SOURCE)
    built = subprocess.run(
        [compiler, "-static", "-Os", "-s", "-o", str(binary), str(source)],
        capture_output=True,
        text=True,
    )
    if built.returncode != 0:
        raise PauseImageError(f"building a static pause binary failed:\n{built.stderr}")
    return binary


def _layer(binary: Path) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("pause")
        data = binary.read_bytes()
        info.size, info.mode = len(data), 0o755
        tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def write_archive(binary: Path, archive: Path, reference: str = REFERENCE) -> Path:
    """Pack ``binary`` as ``/pause`` into a Docker image archive tagged ``reference``."""
    layer = _layer(binary)
    architecture = ARCHITECTURES.get(platform.machine(), platform.machine())
    config = json.dumps(
        {
            "architecture": architecture,
            "os": "linux",
            "config": {"Entrypoint": ["/pause"]},
            "rootfs": {
                "type": "layers",
                "diff_ids": [f"sha256:{hashlib.sha256(layer).hexdigest()}"],
            },
        }
    ).encode()
    config_name = f"{hashlib.sha256(config).hexdigest()}.json"
    manifest = json.dumps(
        [{"Config": config_name, "RepoTags": [reference], "Layers": ["layer.tar"]}]
    ).encode()
    with tarfile.open(archive, mode="w") as tar:
        for name, data in (
            ("manifest.json", manifest),
            (config_name, config),
            ("layer.tar", layer),
        ):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return archive


def build(workdir: Path, reference: str = REFERENCE) -> Path:
    """The pause image archive in ``workdir``, ready for ``ctr images import``."""
    workdir.mkdir(parents=True, exist_ok=True)
    return write_archive(compile_pause(workdir), workdir / "pause-image.tar", reference)
