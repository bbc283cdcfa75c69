"""The spawned side of :mod:`kvstrata.testing.gpuipc`: a process playing a vLLM worker.

It builds KV tensors on the GPU in vLLM's layouts, exports them (CUDA IPC
handles and an interprocess event) and answers the parent's checks over a
multiprocessing pipe; the message shapes are in :mod:`gpuipc`'s docstring.
Kept apart because it runs in another process with its own imports (torch
on CUDA), while the parent side holds the sidecar's objects.
"""

from __future__ import annotations

import traceback
from multiprocessing.connection import Connection
from typing import Any

from kvstrata.testing.gpuipc import (
    POISON_SOURCE,
    POISON_TARGET,
    SLEEP_CYCLES,
    STALL_FACTOR,
    _build,
    _expected_target,
    _export,
)


def worker_main(
    conn: Connection,
    role: str,
    cases: list[tuple[str, str]],
    nbytes: int,
    shape: dict[str, int] | None = None,
    device: int = 0,
) -> None:
    """A spawned worker on GPU ``device``. ``role``: ``source`` (KV written late,
    behind an exported event), ``stall`` (the same, far later: killed while the
    sidecar waits), ``target`` (poisoned KV, checked on request), ``export`` (KV of
    ``shape`` and an event recorded after it, for benchmarks) or ``hog`` (one
    allocation of ``nbytes``, then waits to be killed)."""
    try:
        import torch

        from kvstrata.connector.ipc import IpcReferences
        from kvstrata.testing import chunkref

        torch.cuda.init()
        torch.cuda.set_device(device)
        if role == "hog":
            _hog(conn, nbytes)
            return
        # Given back once the parent closed its handles and said "exit", as the
        # connector's worker does at its end: else torch warns at exit that the
        # producer died with shared tensors outstanding.
        references = IpcReferences()
        built = [(_build(layout, dtype, "cuda", shape), layout, dtype) for layout, dtype in cases]
        payload = [_export(case, layout, dtype, references) for case, layout, dtype in built]
        raws = [
            r for case, _, _ in built for r in chunkref.storage_bytes(list(case.layers.values()))
        ]
        keep: list[Any] = []  # what must outlive the exported handles
        event = _fill_kv(role, raws, keep)
        conn.send(("ready", (payload, None if event is None else bytes(event.ipc_handle()))))
        _answer_checks(conn, built)
        references.release()
    except Exception:
        conn.send(("error", traceback.format_exc()))


def _hog(conn: Connection, nbytes: int) -> None:
    """Hold one allocation of ``nbytes`` until the parent kills this process."""
    import torch

    hog = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    fake = type("Case", (), {"layers": {"hog": hog}})()
    torch.cuda.synchronize()
    conn.send(("ready", [_export(fake, "hog", "uint8")]))
    conn.recv()  # never answered: the parent kills this process


def _fill_kv(role: str, raws: list[Any], keep: list[Any]) -> Any:
    """Put the role's bytes in the KV tensors; the interprocess event recorded after
    them (``source``, ``export``) or None (``target``: poisoned and synchronized)."""
    import torch

    if role == "target":
        for r in raws:
            r.fill_(POISON_TARGET)
        torch.cuda.synchronize()
        return None
    if role in ("source", "stall"):
        truth = [r.clone() for r in raws]
        for r in raws:
            r.fill_(POISON_SOURCE)
        torch.cuda.synchronize()
        # Hold the real bytes back on the GPU (a stalled worker: until it is killed).
        torch.cuda._sleep(SLEEP_CYCLES * (STALL_FACTOR if role == "stall" else 1))
        for r, t in zip(raws, truth, strict=True):
            r.copy_(t)
        keep.append(truth)
    event = torch.cuda.Event(interprocess=True)
    event.record()
    keep.append(event)
    return event


def _answer_checks(conn: Connection, built: list[tuple[Any, str, str]]) -> None:
    """Compare the KV with the CPU reference on each ``check`` until ``exit``."""
    import torch

    from kvstrata.testing import chunkref

    while True:
        message = conn.recv()
        if message[0] == "exit":
            return
        if message[0] != "check":
            continue
        _, src, dst = message
        problems = []
        for case, layout, dtype in built:
            got = chunkref.storage_bytes(list(case.layers.values()))
            want = _expected_target(layout, dtype, src, dst)
            for g, w in zip(got, want, strict=True):
                if not torch.equal(g.cpu(), w):
                    bad = int((g.cpu() != w).sum())
                    problems.append(f"{layout}/{dtype}: {bad} bytes differ")
        conn.send(("checked", "; ".join(problems)))
