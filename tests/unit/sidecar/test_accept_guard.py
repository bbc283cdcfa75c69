"""The accept guard alone (csrc/kvs_accept_guard.c), driven in a child process.

Each driver is a fresh Python process, with the guard preloaded or not, that
runs out of descriptors on purpose: it sets a low ``RLIMIT_NOFILE``, makes
a non-blocking Unix listener and connects clients to it (so connections are
pending), then opens ``/dev/null`` until ``open`` fails with EMFILE. Its
accepts then meet EMFILE deterministically. It prints one JSON line of what
it saw. The preload test also checks that processes the sidecar starts do
not inherit the guard.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvstrata.sidecar import acceptguard

DRIVER = textwrap.dedent(
    """
    import ctypes, errno, json, os, resource, socket, sys

    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    path = sys.argv[1]
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(8)
    listener.setblocking(False)
    clients = []
    for _ in range(2):
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        c.connect(path)
        clients.append(c)
    filler = []
    while True:
        try:
            filler.append(os.open("/dev/null", os.O_RDONLY))
        except OSError as exc:
            assert exc.errno == errno.EMFILE, exc
            break

    def try_accept():
        try:
            conn, _ = listener.accept()
        except OSError as exc:
            return errno.errorcode[exc.errno]
        conn.close()
        return "accepted"

    out = {"accepts": [try_accept() for _ in range(3)]}
    # What each pending client sees: the connection ended (b"") or still open.
    for c in clients:
        c.setblocking(False)
    def state(c):
        try:
            return "ended" if c.recv(1) == b"" else "data"
        except BlockingIOError:
            return "open"
    out["clients"] = [state(c) for c in clients]
    lib = ctypes.CDLL(None)
    if hasattr(lib, "kvs_accept_guard_dropped"):
        lib.kvs_accept_guard_dropped.restype = ctypes.c_ulong
        out["dropped"] = lib.kvs_accept_guard_dropped(listener.fileno())
        out["dropped_other"] = lib.kvs_accept_guard_dropped(listener.fileno() + 1000)
        out["spare"] = lib.kvs_accept_guard_spare()
        out["spare_is_devnull"] = os.path.samefile(f"/proc/self/fd/{out['spare']}", "/dev/null")
    # Two descriptors freed (the late client takes one): its connection is
    # accepted as usual.
    os.close(filler.pop())
    os.close(filler.pop())
    late = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    late.connect(path)
    out["after_one_freed"] = try_accept()
    print(json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def guard_library() -> Path:
    path, why_not = acceptguard.library_path()
    if path is None:
        pytest.fail(f"the accept guard cannot be built here: {why_not}")
    return path


def _drive(tmp_path: Path, preload: Path | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    if preload is not None:
        env["LD_PRELOAD"] = str(preload)
    done = subprocess.run(
        [sys.executable, "-c", DRIVER, str(tmp_path / "listener.sock")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_without_the_guard_an_accept_short_of_descriptors_fails_with_emfile(tmp_path: Path):
    # The condition the guard exists for: what libzmq's ipc listener aborts on.
    seen = _drive(tmp_path, preload=None)
    assert seen["accepts"] == ["EMFILE", "EMFILE", "EMFILE"]
    assert seen["clients"] == ["open", "open"]
    assert "dropped" not in seen


def test_the_guard_answers_eagain_drops_each_pending_peer_and_restores_its_spare(
    tmp_path: Path, guard_library: Path
):
    seen = _drive(tmp_path, preload=guard_library)
    # Never EMFILE: each failed accept drops one pending connection, and with
    # none pending the answer is still "nothing to accept".
    assert seen["accepts"] == ["EAGAIN", "EAGAIN", "EAGAIN"]
    assert seen["clients"] == ["ended", "ended"]
    assert seen["dropped"] == 2
    assert seen["dropped_other"] == 0
    assert seen["spare"] >= 0 and seen["spare_is_devnull"]
    assert seen["after_one_freed"] == "accepted"


PRELOAD_DRIVER = textwrap.dedent(
    """
    import json, os, subprocess, sys
    from kvstrata.sidecar import acceptguard

    state = acceptguard.preload()  # re-executes this process once
    maps = subprocess.run(["cat", "/proc/self/maps"], capture_output=True, text=True).stdout
    print(json.dumps({
        "pid": os.getpid(),
        "loaded": state.loaded,
        "why_not": state.why_not,
        "in_self": any("acceptguard" in line for line in open("/proc/self/maps")),
        "in_child": "acceptguard" in maps,
        "ld_preload": os.environ.get("LD_PRELOAD"),
    }))
    """
)


def test_preload_reexecutes_once_with_the_guard_and_keeps_it_from_children(
    guard_library: Path,
):
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", acceptguard.ENV_SWITCH)}
    env["LD_PRELOAD"] = ""  # as a container may leave it: restored empty, not named
    proc = subprocess.Popen(
        [sys.executable, "-c", PRELOAD_DRIVER], env=env, stdout=subprocess.PIPE, text=True
    )
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    seen = json.loads(out)
    assert seen["pid"] == proc.pid  # the same process, re-executed
    assert seen["loaded"] and seen["in_self"], seen["why_not"]
    assert not seen["in_child"]
    assert not seen["ld_preload"]


def test_preload_switched_off_says_so_and_loads_nothing():
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env[acceptguard.ENV_SWITCH] = "off"
    done = subprocess.run(
        [sys.executable, "-c", PRELOAD_DRIVER], env=env, capture_output=True, text=True,
        timeout=60, check=True,
    )  # fmt: skip
    seen = json.loads(done.stdout)
    assert not seen["loaded"] and not seen["in_self"]
    assert seen["why_not"] == f"{acceptguard.ENV_SWITCH}=off"
