"""A call waiting for its reply ends at once when the sidecar process ends.

The connector's client holds a liveness connection to its sidecar, which the
kernel closes when the sidecar process ends, however it ends. A retrieve in
flight must end then, as a miss, not at its deadline: a vLLM step must not
wait out a deadline for a sidecar that is gone.

Ordered by events: the real sidecar process is stopped (SIGSTOP) so that it
cannot answer; the retrieve is sent, and the test waits until the calling
thread sleeps in ``poll`` for the reply (``/proc/self/task/<tid>/syscall``);
then the sidecar is killed. The call's deadline is ten minutes: the test
waits far less for the call to end.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest

NBYTES = 4096
CALL_DEADLINE_S = 600.0  # a deadline this test never waits out
# The system calls a thread waiting in zmq_poll sleeps in, by machine.
_POLL_SYSCALLS = {"x86_64": {7, 271}, "aarch64": {73}}

pytestmark = pytest.mark.skipif(
    os.uname().machine not in _POLL_SYSCALLS or not os.path.exists("/proc/self/task"),
    reason="reads a thread's system call from /proc on x86_64 or aarch64",
)


def _sleeping_in_poll(tid: int) -> bool:
    try:
        with open(f"/proc/self/task/{tid}/syscall", encoding="ascii") as f:
            number = f.read().split()[0]
    except (OSError, IndexError):
        return False
    return number.isdigit() and int(number) in _POLL_SYSCALLS[os.uname().machine]


def test_a_retrieve_in_flight_ends_as_a_miss_when_the_sidecar_is_killed(sidecar: Any, kit: Any):
    client = sidecar.client(call_timeout_s=CALL_DEADLINE_S)
    keys = kit.make_keys(4, seed=386)
    assert kit.store(client, keys, NBYTES, owner="w") == 4

    sidecar.pause()  # SIGSTOP: the retrieve below gets no reply
    result: dict[str, Any] = {}
    started = threading.Event()

    def retrieve() -> None:
        result["tid"] = threading.get_native_id()
        started.set()
        result["slots"] = client.prepare_retrieve(keys, "r")

    caller = threading.Thread(target=retrieve, daemon=True)
    caller.start()
    assert started.wait(30)
    kit.wait_until(
        lambda: _sleeping_in_poll(result["tid"]),
        timeout=30,
        what="the retrieve waiting for its reply",
        step=0.01,
    )
    sidecar.kill()  # SIGKILL: no goodbye on any socket but what the kernel closes

    caller.join(timeout=60)
    assert not caller.is_alive(), "the retrieve still waits for a sidecar that is gone"
    assert result["slots"] is None  # a miss
    assert client.errors.get("sidecar_gone") == 1, client.errors
    assert client.errors.get("timeout", 0) == 0, client.errors
    # The calls after it answer at once too (the client backs off).
    assert client.lookup(keys, prefetch=False, owner="r2") is None
    client.close()
