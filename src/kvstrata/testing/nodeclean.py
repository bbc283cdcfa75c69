"""What a node leaves on the machine once its kubelet and containerd are gone, removed.

Why this module exists: the suite's node shares the machine with everything
else on it, and a test run that fails half-way must still leave nothing
behind. Containers outlive the kubelet (runc's shims re-parent them), and
pods leave mounts (their rootfs overlays, tmpfs volumes, network namespaces
under containerd's state folder) and cgroups. Each step here is safe to run
when there is nothing to do, and reports what it could not undo instead of
stopping at the first failure.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
import time
from pathlib import Path

from kvstrata.testing.poll import wait_until

CGROUP_V1 = Path("/sys/fs/cgroup")


def cgroup_hierarchies() -> list[Path]:
    """The mounted cgroup v1 hierarchies (cpu, memory, pids, ...), the unified one included."""
    if not CGROUP_V1.is_dir():
        return []
    return sorted(p for p in CGROUP_V1.iterdir() if p.is_dir() and not p.is_symlink())


def make_cgroup_root(name: str) -> None:
    """Create ``/name`` in every hierarchy: the kubelet checks its cgroupRoot exists.

    A new cpuset cgroup starts with no CPUs and no memory nodes (v1 copies
    nothing down unless ``cgroup.clone_children`` says so): copy the parent's.
    """
    for hierarchy in cgroup_hierarchies():
        folder = hierarchy / name
        folder.mkdir(exist_ok=True)
        for knob in ("cpuset.cpus", "cpuset.mems"):
            if (folder / knob).exists():
                (folder / knob).write_text((hierarchy / knob).read_text())


def _cgroup_folders(name: str) -> list[Path]:
    """Every cgroup under ``/name`` in every hierarchy, deepest first."""
    found = []
    for hierarchy in cgroup_hierarchies():
        root = hierarchy / name
        if root.is_dir():
            for folder, _, _ in os.walk(root, topdown=False):
                found.append(Path(folder))
    return found


def kill_cgroup_processes(name: str) -> int:
    """SIGKILL every process in the cgroups under ``/name`` (the pods' containers)."""
    pids: set[int] = set()
    for folder in _cgroup_folders(name):
        try:
            pids.update(int(p) for p in (folder / "cgroup.procs").read_text().split())
        except OSError:
            continue
    _kill_and_reap(pids)
    return len(pids)


def remove_cgroups(name: str, timeout: float = 30) -> list[str]:
    """Remove the cgroups under ``/name``; return what could not be removed.

    A cgroup refuses removal (EBUSY) while a task is in it, and a killed
    process's threads leave it only once each has exited: its leader can be a
    zombie already (so :func:`_kill_and_reap` counts it gone) while the other
    threads of a big process (vLLM's) still tear down. So EBUSY is retried
    until ``timeout``; any other error, or EBUSY past it, is a failure.
    """
    failures = []
    deadline = time.monotonic() + timeout
    for folder in _cgroup_folders(name):
        busy: list[OSError] = []

        def removed(folder: Path = folder, busy: list[OSError] = busy) -> bool:
            try:
                folder.rmdir()
            except OSError as exc:
                if exc.errno != errno.EBUSY:
                    raise
                busy.append(exc)
                return False
            return True

        try:
            left = max(deadline - time.monotonic(), 0.0)
            wait_until(removed, left, f"cgroup {folder} to empty", step=0.1)
        except OSError as exc:
            failures.append(f"cgroup {folder}: {exc}")
        except AssertionError:
            failures.append(f"cgroup {folder}: {busy[-1]}")
    return failures


def kill_shims(containerd_socket: Path) -> int:
    """SIGKILL the runc shims this containerd started (their command line names its socket)."""
    needle = str(containerd_socket).encode()
    shims = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if b"containerd-shim" in cmdline and needle in cmdline:
            shims.add(int(entry.name))
    _kill_and_reap(shims)
    return len(shims)


def _kill_and_reap(pids: set[int], timeout: float = 30) -> None:
    """SIGKILL ``pids`` and wait until they are gone: a shim that is still exiting
    unmounts its container's rootfs under our feet, racing the unmount step."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    wait_until(
        lambda: not any(_alive(pid) for pid in pids),
        timeout,
        f"processes {sorted(pids)} to exit after SIGKILL",
        step=0.1,
    )


def _alive(pid: int) -> bool:
    """Still there and not a zombie (a zombie holds no mount and no cgroup)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def mounts_under(folder: Path) -> list[Path]:
    """Mount points at or below ``folder``, deepest first (from /proc/self/mountinfo)."""
    prefix = str(folder.resolve())
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        # Field 5 is the mount point, with spaces and the like written as octal escapes.
        point = line.split()[4].encode().decode("unicode_escape")
        if point == prefix or point.startswith(prefix + "/"):
            found.append(Path(point))
    return sorted(set(found), key=lambda p: len(p.parts), reverse=True)


def unmount_under(folder: Path) -> list[str]:
    """Unmount everything below ``folder``; lazily where a mount is still busy."""
    failures = []
    for point in mounts_under(folder):
        done = subprocess.run(["umount", str(point)], capture_output=True, text=True)
        if done.returncode != 0:
            lazy = subprocess.run(["umount", "-l", str(point)], capture_output=True, text=True)
            # Gone meanwhile (its owner unmounted it, or it went with a parent) is done too.
            if lazy.returncode != 0 and point in mounts_under(folder):
                failures.append(f"umount {point}: {lazy.stderr.strip()}")
    return failures
