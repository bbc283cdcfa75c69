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

import contextlib
import os
import signal
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


def _retrieve_waiting_for_its_reply(
    client: Any, keys: list[Any], kit: Any
) -> tuple[threading.Thread, dict[str, Any]]:
    """A retrieve on its own thread, returned once that thread sleeps in ``poll``
    for the reply: what the sidecar does next happens mid-call (``result["slots"]``
    holds what the call returned once the thread ends)."""
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
    return caller, result


def test_a_retrieve_in_flight_ends_as_a_miss_when_the_sidecar_is_killed(sidecar: Any, kit: Any):
    client = sidecar.client(call_timeout_s=CALL_DEADLINE_S)
    keys = kit.make_keys(4, seed=386)
    assert kit.store(client, keys, NBYTES, owner="w") == 4

    sidecar.pause()  # SIGSTOP: the retrieve below gets no reply
    caller, result = _retrieve_waiting_for_its_reply(client, keys, kit)
    sidecar.kill()  # SIGKILL: no goodbye on any socket but what the kernel closes

    caller.join(timeout=60)
    assert not caller.is_alive(), "the retrieve still waits for a sidecar that is gone"
    assert result["slots"] is None  # a miss
    assert client.errors.get("sidecar_gone") == 1, client.errors
    assert client.errors.get("timeout", 0) == 0, client.errors
    # The calls after it answer at once too (the client backs off).
    assert client.lookup(keys, prefetch=False, owner="r2") is None
    client.close()


def test_a_retrieve_in_flight_ends_as_a_miss_when_the_sidecar_stops_on_sigterm(
    sidecar: Any, kit: Any
):
    """SIGTERM: the sidecar stops serving and closes its liveness socket first;
    a retrieve it will never answer must end then. The retrieve is made
    unanswerable by a fault the real parts cannot produce: the chunk's L2 file
    is replaced by a FIFO (named here as the injected fault), whose open blocks
    the sidecar's promotion until the test writes to it."""
    keys = kit.make_keys(1, seed=387)
    writer = sidecar.client()
    assert kit.store(writer, keys, NBYTES, owner="w") == 1
    kit.wait_until(
        lambda: sidecar.status()["tiers"]["l2"]["objects"] >= 1,
        timeout=30,
        what="the chunk written behind to L2",
    )
    writer.close()
    sidecar.restart()  # L1 empty, L2 re-indexed: the chunk is in L2 only
    files = [p for p in (sidecar.root / "l2").rglob("*") if p.is_file()]
    assert len(files) == 1, files
    fifo = files[0].with_name("injected-fault.fifo")
    os.mkfifo(fifo)
    os.replace(fifo, files[0])

    client = sidecar.client(call_timeout_s=CALL_DEADLINE_S)
    assert client.ping(), client.errors
    caller, result = _retrieve_waiting_for_its_reply(client, keys, kit)
    assert sidecar.proc is not None
    sidecar.proc.send_signal(signal.SIGTERM)
    try:
        caller.join(timeout=60)
        assert not caller.is_alive(), "the retrieve still waits for a sidecar that stopped"
        assert result["slots"] is None  # a miss
        assert client.errors.get("sidecar_gone") == 1, client.errors
    finally:
        # Let the blocked promotion go, as often as it opens the FIFO (once
        # past the page cache, once through it): each open finds a writer that
        # closes at once, so its read ends at EOF (a short object: a miss) and
        # the sidecar can finish stopping.
        def released() -> bool:
            with contextlib.suppress(OSError):  # ENXIO: no reader waiting now
                os.close(os.open(files[0], os.O_WRONLY | os.O_NONBLOCK))
            return sidecar.proc.poll() is not None

        kit.wait_until(released, timeout=60, what="the sidecar stopping", step=0.01)
    assert sidecar.proc.returncode == 0, sidecar.log()
    client.close()
