"""``kvstrata selftest gpu``'s killed-peer checks: a vLLM that dies mid-save or mid-load.

A worker process exports its KV and an interprocess event recorded behind
a long GPU sleep (its forward pass, still running). The sidecar side
(real :class:`~kvstrata.sidecar.transfer.ipc.IpcTransfers` and
:class:`~kvstrata.sidecar.transfer.cuda_device.CudaDevice`) starts the
save; once the sidecar has seen the event pending (counted by
:class:`~kvstrata.testing.gpuipc.EventWatch`, no sleep), the worker is
SIGKILLed and its session closed, as the liveness socket does. The save
must return without committing, the GPU must not be marked faulted, and
a new worker's save must then go through: nothing is wedged and nothing
of the dead worker stays mapped.

:func:`check_killed_peer_during_load` does the same to a LOAD_BLOCKS: the
sidecar waits for the stalled worker's event (vLLM's previous step, still
running) before it may write the worker's blocks; the worker is killed,
its session closed, and the load must end reporting nothing loaded, with
the device free for the next worker's save.
"""

from __future__ import annotations

import os
import signal
import tempfile
import threading
from collections.abc import Callable
from typing import Any, Literal

from kvstrata.testing.gpuipc import (
    CHUNKS,
    REPLY_SECONDS,
    CheckFailed,
    EventWatch,
    _ids,
    _keys,
    _per_chunk,
    _receive,
    _registration,
    _save_from_source_worker,
    _worker,
)

CASE = ("LBNHC", "bfloat16")


def check_killed_peer(lib: Any) -> str:
    """See the module docstring. Raises CheckFailed."""
    _, after = _kill_the_stalled_peer(lib, "save")
    return (
        f"a save waiting for a SIGKILLed worker's event ended at its session's end, "
        f"{CHUNKS} chunks not stored, nothing mapped; then {after}"
    )


def check_killed_peer_during_load(lib: Any) -> str:
    """See the module docstring. Raises CheckFailed."""
    saved, after = _kill_the_stalled_peer(lib, "load")
    return (
        f"{saved}; a load waiting for a SIGKILLed worker's event ended at its session's "
        f"end, nothing loaded, nothing mapped; then {after}"
    )


def _kill_the_stalled_peer(lib: Any, call: Literal["save", "load"]) -> tuple[str, str]:
    """Both checks' one scenario, for a save or a load: what a first worker's
    save said (a load's chunks; "" for a save) and what the next worker's did."""
    import torch

    from kvstrata.sidecar import protocol as p
    from kvstrata.sidecar.config import config_from_dict
    from kvstrata.sidecar.engine import StorageManager
    from kvstrata.sidecar.transfer.cuda_device import CudaDevices
    from kvstrata.sidecar.transfer.ipc import IpcTransfers

    src, dst = _ids()
    with tempfile.TemporaryDirectory(prefix="kvstrata-selftest-") as tmp:
        config = config_from_dict(
            {
                "chunk_size": 64,
                "l1": {"size_bytes": "64Mi", "pin_memory": True},
                "l2": {"path": os.path.join(tmp, "l2"), "size_bytes": "64Mi"},
            }
        )
        engine = StorageManager(config)
        watch = EventWatch(lib)
        devices = CudaDevices(watch, engine.arena)
        arena = torch.frombuffer(engine.arena.buffer, dtype=torch.uint8)
        try:
            ipc = IpcTransfers(engine, devices)
            saved = ""
            if call == "load":
                # The chunks the load will ask for, stored from a first worker.
                saved = _save_from_source_worker(lib, ipc, engine, arena, [CASE], src, None)
                watch.waiting.clear()
            with _worker("stall", [CASE]) as (proc, conn):
                (kv,), event = _receive(conn, "exporting the stalled KV")
                ipc.register("stalled", _registration(kv))
                send: Callable[[str, Any, str], Any]
                if call == "save":
                    body: Any = p.SaveBlocksRequest(_keys(kv), _per_chunk(src), event)
                    send = ipc.save
                else:
                    body = p.LoadBlocksRequest(_keys(kv), _per_chunk(dst), after_event=event)
                    send = ipc.load
                replies: list[Any] = []
                caller = threading.Thread(
                    target=lambda: replies.append(send("stalled", body, "selftest")),
                    daemon=True,
                )
                caller.start()
                if not watch.waiting.wait(REPLY_SECONDS):
                    raise CheckFailed("the sidecar never saw the stalled worker's event pending")
                # A save's worker dies mid forward pass, a load's mid step: as an OOM kill.
                os.kill(proc.pid, signal.SIGKILL)
                proc.join(30)
                ipc.close("stalled")  # what the session's closed liveness socket does
                caller.join(REPLY_SECONDS)
            if caller.is_alive():
                raise CheckFailed(f"the {call} still waits for a killed worker's event: wedged")
            if call == "save" and (not replies or any(replies[0].committed)):
                raise CheckFailed(f"a killed worker's unfinished KV was stored: {replies}")
            if call == "load" and (not replies or replies[0].loaded):
                raise CheckFailed(f"a load into a killed worker's KV was reported: {replies}")
            if ipc.fault:
                raise CheckFailed(f"the GPU was marked faulted by a peer's death: {ipc.fault}")
            if len(ipc):
                raise CheckFailed("the killed worker's KV is still mapped")
            # The device still serves: another worker's save of other chunks goes
            # through (a load's first worker stored this prompt's already).
            arena.fill_(0)
            after = _save_from_source_worker(lib, ipc, engine, arena, [CASE], src, None, "again/")
        finally:
            del arena
            devices.close()
            engine.close()
    return saved, after
