"""Shared memory that never faults: an arena that does not fit ``/dev/shm`` is
refused (or shrunk) at start, a restarted sidecar removes the segments its
killed predecessors left, and the connector lets go of an old arena.

The crash tests run where it failed: a private tmpfs over ``/dev/shm`` of the
size the operator gives a pod (L1 + 10% + 256Mi), in a mount namespace of
their own (``unshare -m``, root only), holding a sidecar and a client.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

MIB = 1 << 20


def _private_shm_skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "mounting a private tmpfs over /dev/shm needs root (CAP_SYS_ADMIN)"
    if shutil.which("unshare") is None:
        return "util-linux unshare is not installed"
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m probe /dev/shm"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if probe.returncode != 0:
        return f"this machine refuses a private mount namespace: {probe.stderr.strip()}"
    return None


_SKIP = _private_shm_skip_reason()
needs_private_shm = pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")


def _in_private_shm(size: str, argv: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Run ``argv`` with a fresh tmpfs of ``size`` over ``/dev/shm`` (gone when it exits).

    It runs in a process group of its own, killed afterwards: a client that
    dies of a signal leaves no sidecar it started behind.
    """
    script = f'mount -t tmpfs -o size={size} kvstrata-test /dev/shm && exec "$@"'
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTRATA_")}
    proc = subprocess.Popen(
        ["unshare", "-m", "sh", "-c", script, "sh", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**env, "PYTHONUNBUFFERED": "1"},
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _operator_shm_size(l1_bytes: int) -> str:
    """The pod's /dev/shm as the operator sizes it: L1 + 10% + 256Mi."""
    return f"{(l1_bytes + l1_bytes // 10 + 256 * MIB) // 1024}k"


@needs_private_shm
def test_an_arena_larger_than_dev_shm_is_refused_at_start_naming_the_field_and_the_free_room(
    sidecar_factory: Any, kit: Any
):
    sidecar = sidecar_factory(overrides={"l1": {"size_bytes": "64Mi"}})
    done = _in_private_shm(
        "32m", [*kit.SIDECAR_COMMAND, "--config", str(sidecar.config_path)], timeout=60
    )
    assert done.returncode == 1, done.stderr
    assert "l1.size_bytes" in done.stderr
    assert f"{64 * MIB} bytes" in done.stderr
    assert "free" in done.stderr and "MiB" in done.stderr
    assert "Traceback" not in done.stderr


_FIT_PROBE = textwrap.dedent(
    """
    import os, sys
    from kvstrata.sidecar.config import config_from_dict
    from kvstrata.sidecar.engine import StorageManager
    config = config_from_dict({"l1": {"size_bytes": "64Mi", "fit_to_shm": True,
                                      "pin_memory": False}, "l2": {"enabled": False}})
    with StorageManager(config) as engine:
        st = os.stat(engine.arena.path)
        # st_blocks: 512-byte units really allocated (reserved), not a sparse file
        print(engine.arena.size, st.st_size, st.st_blocks * 512)
    """
)


@needs_private_shm
def test_with_fit_to_shm_the_arena_shrinks_to_the_room_there_is_and_reserves_it():
    done = _in_private_shm("40m", [sys.executable, "-c", _FIT_PROBE], timeout=60)
    assert done.returncode == 0, done.stderr
    size, file_size, allocated = (int(x) for x in done.stdout.split())
    assert size == file_size == allocated
    assert size % MIB == 0
    assert 30 * MIB <= size <= 36 * MIB  # 40 MiB less 10% for others
    assert "fit_to_shm" in done.stderr


_CRASH_CYCLES = textwrap.dedent(
    """
    import hashlib, os, sys
    from pathlib import Path
    from kvstrata.connector.client import SidecarClient
    from kvstrata.sidecar.keys import ChunkKey, Namespace
    from kvstrata.testing.poll import wait_until
    from kvstrata.testing.sidecarproc import SidecarProcess

    root, cycles, l1 = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    MIB = 1 << 20
    ns = Namespace(model="kvstrata-test-model", block_size=16, chunk_size=16)
    fp = ns.fingerprint()
    sidecar = SidecarProcess(root, chunk_size=16, l1_size=str(l1), l2_size="16Mi",
                             overrides={"l2": {"enabled": False}})
    client = SidecarClient(sidecar.endpoint, ns, role="worker", call_timeout_s=5)
    for cycle in range(cycles):
        sidecar.start()
        wait_until(client.ping, 20, "the client is back")
        segments = sorted(n for n in os.listdir("/dev/shm") if n.startswith("kvstrata-"))
        stored = refused = 0
        for i in range(l1 // MIB + 16):  # more than L1 holds: it evicts
            key = ChunkKey(fp + hashlib.sha256(f"{cycle}/{i}".encode()).digest())
            slots = client.prepare_store([key], MIB, "uint8", (MIB,), "w")
            if not slots or slots[0] is None:
                refused += 1
                continue
            arena = client.arena
            arena[slots[0].offset : slots[0].offset + MIB] = bytes([cycle + 1]) * MIB
            del arena
            stored += client.commit_store([slots[0].lease_id], [True])
        print(cycle, len(segments), stored, refused, flush=True)
        sidecar.kill()
    """
)


@needs_private_shm
def test_sidecar_crashes_and_restarts_in_a_pod_sized_dev_shm_cost_misses_never_a_signal(
    tmp_path: Path,
):
    l1, cycles = 64 * MIB, 6  # five stale arenas no longer fit beside a sixth
    done = _in_private_shm(
        _operator_shm_size(l1),
        [sys.executable, "-c", _CRASH_CYCLES, str(tmp_path / "sc"), str(cycles), str(l1)],
        timeout=240,
    )
    assert done.returncode == 0, (
        f"the client process ended with {done.returncode} "
        f"(negative: killed by that signal): {done.stderr[-2000:]}"
    )
    rows = [[int(x) for x in line.split()] for line in done.stdout.splitlines()]
    assert [row[0] for row in rows] == list(range(cycles))
    for cycle, segments, stored, _refused in rows:
        assert segments == 1, f"cycle {cycle}: {segments} arena segments in /dev/shm"
        assert stored >= 32, f"cycle {cycle}: only {stored} chunks stored"
    assert "removed 1 stale arena segment" in (tmp_path / "sc" / "sidecar.log").read_text()


def _mapped(name: str) -> bool:
    return name in Path("/proc/self/maps").read_text()


def test_the_connector_unmaps_the_arena_of_a_sidecar_that_is_gone(sidecar_factory: Any, kit: Any):
    sidecar = sidecar_factory().start()
    client = sidecar.client(call_timeout_s=0.3)
    kit.store(client, kit.make_keys(2, seed=90), 4096, owner="w")
    name = sidecar.status()["arena"]["name"]
    assert _mapped(name)
    sidecar.kill()
    kit.wait_until(lambda: not client.ping() and not _mapped(name), 10, "the old arena unmapped")
    assert client.arena is None
    sidecar.start()
    kit.wait_until(client.ping, 10, "the client reconnects")
    assert _mapped(sidecar.status()["arena"]["name"])
    client.close()


def test_a_restarted_sidecar_removes_the_segment_its_killed_predecessor_left(
    sidecar_factory: Any,
):
    sidecar = sidecar_factory().start()
    old = sidecar.status()["arena"]["name"]
    sidecar.kill()
    assert os.path.exists(f"/dev/shm/{old}")
    other = sidecar_factory("other").start()  # another endpoint: its prefix is not ours
    sidecar.start()
    assert not os.path.exists(f"/dev/shm/{old}")
    assert os.path.exists(f"/dev/shm/{other.status()['arena']['name']}")
