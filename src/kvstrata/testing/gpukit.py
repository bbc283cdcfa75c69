"""The GPU kit's checks: everything a lent GPU machine must show, in one run.

Why a module of its own: ``make gpu-kit`` (:mod:`kvstrata.testing.gpukit_build`)
packs the project and the wheels it needs into a folder that runs on a
machine with a CUDA GPU, Python and PyTorch but no network and no vLLM,
often lent for a few minutes only. Its script (``tests/gpu/kit/run.sh``)
installs the wheels, builds ``csrc/`` with nvcc and then runs this module,
which prints one line per check and writes every result to a JSON file.

The checks, in order (each a function of :mod:`kvstrata.testing` that the
``gpu`` tests and ``kvstrata selftest gpu`` run too):

==================  ===============================================================
``kernels``         the csrc kernels against torch's own copy, every layout x dtype,
                    chunks in device and in pinned host memory
``torch-copier``    the connector's host-mode copier on CUDA tensors, same reference
``connector-stream``  host-mode loads ordered before attention on vLLM's stream
``handle-format``   the storage handle this torch writes (its format version) and
                    the connector reading it, and the same payload in the other
                    versions torch writes (2.11's and 2.13's)
``ipc-round-trip``  save from one process over CUDA IPC, load into another
``handle-cleanup``  a SIGKILLed exporter's memory back once its handle is closed
``killed-peer-save``  a worker killed while a save waits for its event; GPU
                    memory back to its baseline
``killed-peer-load``  the same during a load
``device-context``  a sidecar process opening the workers' GPU by UUID and
                    running its calls from fresh threads holds a context on that
                    GPU and on no other (NVML's process list, else free memory)
``bench``           ``kvstrata bench transfer --quick``: the sidecar's copy paths
                    against pinned ``cudaMemcpyAsync`` (and the batched DMA
                    baseline where the bench has it)
==================  ===============================================================

Exit code: 0 all passed, 1 one failed, 2 the checks cannot run here (the
line says why, "no CUDA device: ..." without a GPU).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvstrata.testing import selftest
from kvstrata.testing.gpuipc import CLEANUP_DEADLINE_SECONDS, CLEANUP_MARGIN, CheckFailed

# torch writes a format-version byte before a 'c' + 64-byte cudaIpcMemHandle_t:
# 1 and 2 in the releases before 2.13, 3 in 2.13 (what the kit feeds the connector).
TORCH_HANDLE_VERSIONS = (1, 2, 3)


def _free_bytes(lib: Any, device: int) -> int:
    return int(lib.mem_get_info(device)[0])


def with_memory_baseline(check: Callable[[Any], str]) -> Callable[[], str]:
    """``check(lib)``, then CheckFailed unless the workers' GPU has its free memory
    back (within :data:`CLEANUP_MARGIN`) once the check is over."""

    def run() -> str:
        import torch

        from kvstrata.testing.gpuipc import worker_device

        lib = selftest.cuda_library()
        device = worker_device()
        torch.cuda.synchronize()
        before = _free_bytes(lib, device)
        detail = check(lib)
        deadline = time.monotonic() + CLEANUP_DEADLINE_SECONDS
        while (now := _free_bytes(lib, device)) < before - CLEANUP_MARGIN:
            if time.monotonic() > deadline:
                raise CheckFailed(
                    f"{detail}; but {(before - now) >> 20} MiB of GPU memory stayed in use "
                    f"{CLEANUP_DEADLINE_SECONDS:.0f} s after the check"
                )
            time.sleep(0.1)
        return f"{detail}; GPU memory back to baseline ({(before - now) >> 20} MiB apart)"

    return run


def check_handle_format() -> str:
    """The storage handle this torch writes, read by the connector in every version."""
    import torch

    from kvstrata.connector import ipc as connector_ipc

    t = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    exported = t.untyped_storage()._share_cuda_()
    shared = bytes(exported[1])
    # Given back at once (no consumer opens it): else torch warns at the kit's exit
    # that the producer died with shared tensors outstanding.
    references = connector_ipc.IpcReferences()
    references.take(exported[4], exported[5])
    references.release()
    if len(shared) == 64:
        written = "a bare 64-byte handle"
        payload = shared
    else:
        written = f"format version {shared[0]}, type {chr(shared[1])!r}"
        payload = shared[2:]
    refused = []
    if connector_ipc.cuda_memory_handle(shared) != payload:
        refused.append(f"torch {torch.__version__}'s own handle read wrong")
    for version in TORCH_HANDLE_VERSIONS:
        try:
            if connector_ipc.cuda_memory_handle(bytes([version]) + b"c" + payload) != payload:
                refused.append(f"version {version}: payload read wrong")
        except ValueError as exc:
            refused.append(f"version {version}: {exc}")
    if refused:
        raise CheckFailed(f"torch {torch.__version__} writes {written}; " + "; ".join(refused))
    return (
        f"torch {torch.__version__} writes {written}; versions "
        f"{', '.join(map(str, TORCH_HANDLE_VERSIONS))} all read"
    )


# Run in a process of its own without torch: only the sidecar's library touches
# CUDA there, so every context it holds is one the sidecar made.
_CONTEXT_PROBE = textwrap.dedent(
    """
    import sys, threading
    from kvstrata.sidecar.arena import Arena
    from kvstrata.sidecar.transfer import kernels
    from kvstrata.sidecar.transfer.cuda_device import CudaDevices
    lib = kernels.load_cuda()
    arena = Arena(4 << 20, pin_memory=False)
    devices = CudaDevices(lib, arena)
    device = devices(sys.argv[1])
    errors = []
    def fresh_thread(fn):
        def run():
            try:
                fn()
            except Exception as exc:
                errors.append(repr(exc))
        t = threading.Thread(target=run)
        t.start()
        t.join()
    # What the liveness and pool threads do: calls on threads that never chose a device.
    fresh_thread(lambda: lib.mem_get_info(device.index))
    fresh_thread(lambda: lib.stream_destroy(device.index, lib.stream_create(device.index)))
    fresh_thread(device.close)
    fresh_thread(devices.close)
    print("probe", device.index, "|".join(errors), flush=True)
    sys.stdin.readline()
    arena.close()
    """
)


def _nvml_contexts(pid: int) -> list[int] | None:
    """Indices of the NVML devices listing ``pid`` as a compute process; None when
    NVML is not importable or lists no process anywhere (a PID namespace hides them)."""
    try:
        import pynvml
    except ImportError:
        return None
    pynvml.nvmlInit()
    try:
        seen_any, found = False, []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
            seen_any = seen_any or bool(procs)
            if any(p.pid == pid for p in procs):
                found.append(i)
        return found if seen_any else None
    finally:
        pynvml.nvmlShutdown()


def check_device_context() -> str:
    """See the module docstring: a context on the chosen GPU only."""
    import torch

    from kvstrata.testing.gpuipc import worker_device

    lib = selftest.cuda_library()
    target = worker_device()
    uuid = str(torch.cuda.get_device_properties(target).uuid)
    count = torch.cuda.device_count()
    for i in range(count):  # this process's contexts exist before the baseline
        torch.cuda.synchronize(i)
    free_before = [_free_bytes(lib, i) for i in range(count)]
    probe = subprocess.Popen(
        [sys.executable, "-c", _CONTEXT_PROBE, uuid],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert probe.stdout is not None and probe.stdin is not None
        line = probe.stdout.readline().split(" ", 2)
        if len(line) < 2 or line[0] != "probe":
            raise CheckFailed(f"the probe process failed (exit {probe.wait(30)})")
        errors = line[2].strip() if len(line) > 2 else ""
        if errors:
            raise CheckFailed(f"calls on fresh threads failed: {errors}")
        nvml = _nvml_contexts(probe.pid)
        taken = [(before - _free_bytes(lib, i)) >> 20 for i, before in enumerate(free_before)]
        probe.stdin.write("\n")
        probe.stdin.flush()
    finally:
        probe.wait(30)
    others = [i for i in range(count) if i != target]
    if nvml is not None:
        if nvml != [target]:
            raise CheckFailed(f"NVML lists the sidecar process on devices {nvml}, not [{target}]")
        how = "NVML lists it on the chosen device only"
    else:
        grown = [i for i in others if taken[i] > 256]
        if grown:
            raise CheckFailed(f"devices {grown} lost {[taken[i] for i in grown]} MiB to it")
        how = f"free memory (MiB taken per device: {taken})"
    where = f"{count} GPUs" if others else "1 GPU: no other device to keep clean"
    return f"context on device {target} by UUID, none elsewhere ({where}); {how}"


def check_bench() -> str:
    from kvstrata.bench import transfer

    result = transfer.run(argparse.Namespace(quick=True))
    check_bench.result = result  # type: ignore[attr-defined]
    return "kvstrata bench transfer --quick figures in the JSON (bench)"


def checks() -> dict[str, Callable[[], str]]:
    from kvstrata.testing import gpupeers

    return {
        "kernels": selftest.check_kernels,
        "torch-copier": selftest.check_torch_copier,
        "connector-stream": selftest.check_connector_stream,
        "handle-format": check_handle_format,
        "ipc-round-trip": selftest.check_ipc_round_trip,
        "handle-cleanup": selftest.check_handle_cleanup,
        "killed-peer-save": with_memory_baseline(gpupeers.check_killed_peer),
        "killed-peer-load": with_memory_baseline(gpupeers.check_killed_peer_during_load),
        "device-context": check_device_context,
        "bench": check_bench,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvstrata.testing.gpukit")
    parser.add_argument("--json", type=Path, required=True, help="where to write the results")
    parser.add_argument("--only", nargs="*", default=None, help="run these checks only")
    args = parser.parse_args(argv)
    reason = selftest.cannot_run_reason()
    record: dict[str, Any] = {"ok": False, "python": sys.version.split()[0], "checks": []}
    if reason is not None:
        print(reason, flush=True)
        record["skipped"] = reason
        args.json.write_text(json.dumps(record, indent=2))
        return 2
    import torch

    from kvstrata.bench.machine import machine_info

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    record.update(torch=torch.__version__, cuda=torch.version.cuda, machine=machine_info())
    for name, check in checks().items():
        if args.only and name not in args.only:
            continue
        result = selftest.run_check(name, check)
        print(selftest._line(result), flush=True)
        record["checks"].append(asdict(result))
        args.json.write_text(json.dumps(record, indent=2, default=str))
    bench = getattr(check_bench, "result", None)
    if bench is not None:
        record["bench"] = bench
    record["ok"] = bool(record["checks"]) and all(c["ok"] for c in record["checks"])
    args.json.write_text(json.dumps(record, indent=2, default=str))
    print(f"{'PASS' if record['ok'] else 'FAIL'} all: results in {args.json}", flush=True)
    os.sync()
    return 0 if record["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
