"""``make gpu-kit``: the folder a lent, offline GPU machine runs the GPU checks from.

Why: GPU machines are often lent for minutes, with CUDA, Python 3.12 and
PyTorch installed but no network and no vLLM; the project's venv (another
Python, CPU torch) cannot travel there, and neither can a pip index. The
kit carries what the checks need and nothing else::

    gpu-kit/
      run.sh              the driver (tests/gpu/kit/run.sh): venv, csrc build, checks,
                          then pytest -m gpu tests/gpu
      requirements.txt    what the checks import beyond torch (tests/gpu/kit/)
      wheels/*.whl        cp312 manylinux x86_64 wheels of those and their needs
      kvstrata/           the project's source (tracked and new files, no build output)

``python -m kvstrata.testing.gpukit_build DEST`` makes it (pip downloads
the wheels, so this step needs the registry); the kit refuses to be larger
than :data:`MAX_KIT_BYTES`. ``DEST/run.sh`` on the GPU machine does the rest
(:mod:`kvstrata.testing.gpukit` says what it checks).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

MAX_KIT_BYTES = 60 << 20
KIT_FILES = Path("tests/gpu/kit")
# A test double of the one vLLM name the connector's worker side needs at import
# (run.sh puts it on PYTHONPATH where no vLLM is installed).
VLLM_STANDIN = KIT_FILES / "vllm_standin"
PYTHON_VERSION = "3.12"
# pip matches manylinux tags exactly: every glibc a wheel of the checks' needs was seen built for.
PLATFORMS = (
    "manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_26_x86_64",
    "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_5_x86_64",
    "manylinux1_x86_64",
)  # fmt: skip


class KitError(RuntimeError):
    """The kit could not be made; the message says which step failed."""


def source_files(repo: Path) -> list[str]:
    """The files of the checkout that travel: tracked and new ones, no ignored output."""
    out = subprocess.run(
        ["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True, check=True,
    ).stdout  # fmt: skip
    return sorted({name for name in out.decode().split("\0") if name})


def copy_source(repo: Path, dest: Path) -> None:
    """Copy :func:`source_files` into ``dest``, links kept as links (src/kvstrata's)."""
    for name in source_files(repo):
        src = repo / name
        if not src.exists() and not src.is_symlink():
            continue  # deleted in the work tree, not yet in the index
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            target.symlink_to(src.readlink())
        elif src.is_file():
            shutil.copy2(src, target)


def download_wheels(requirements: Path, dest: Path) -> None:
    """cp312 manylinux wheels of ``requirements`` and everything they need."""
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    command = [
        sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check",
        "--only-binary=:all:", "--python-version", PYTHON_VERSION, "--implementation", "cp",
        *platforms, "-d", str(dest), "-r", str(requirements),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise KitError(f"pip download failed ({done.returncode}):\n{done.stderr[-3000:]}")


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file() and not f.is_symlink())


def build_kit(repo: Path, dest: Path) -> int:
    """Make the kit in ``dest`` (replaced if there); its size in bytes. Raises KitError."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    kit_files = repo / KIT_FILES
    shutil.copy2(kit_files / "run.sh", dest / "run.sh")
    shutil.copy2(kit_files / "requirements.txt", dest / "requirements.txt")
    copy_source(repo, dest / "kvstrata")
    download_wheels(dest / "requirements.txt", dest / "wheels")
    size = folder_bytes(dest)
    if size > MAX_KIT_BYTES:
        raise KitError(f"the kit is {size >> 20} MiB, over its {MAX_KIT_BYTES >> 20} MiB")
    return size


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvstrata.testing.gpukit_build")
    parser.add_argument("dest", type=Path, help="the kit's folder (replaced)")
    parser.add_argument("--repo", type=Path, default=Path.cwd(), help="the checkout")
    args = parser.parse_args(argv)
    try:
        size = build_kit(args.repo.resolve(), args.dest.resolve())
    except KitError as exc:
        print(f"gpu-kit: {exc}", file=sys.stderr)
        return 1
    wheels = len(list((args.dest / "wheels").glob("*.whl")))
    print(f"gpu-kit: {args.dest} ({size / (1 << 20):.1f} MiB, {wheels} wheels); "
          f"on the GPU machine: {args.dest.name}/run.sh")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
