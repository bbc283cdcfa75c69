"""``kvstrata selftest gpu``: what only a GPU can show, checked on the node it runs on.

The CPU test suites run the kernels' index code (host build), the ipc
protocol (a shared-memory stand-in for the GPU) and the ctypes binding
(against a CUDA library that finds no driver). This command runs the rest
where a GPU is, e.g. in the sidecar's CUDA image on a GPU node:

1. ``kernels``: the csrc CUDA kernels against the torch reference
   (:mod:`kvstrata.testing.chunkref`) on every layout x KV dtype, chunks in
   device memory and in pinned host memory (zero-copy), gather and
   scatter, plus one batch too large for the kernel parameters;
2. ``torch-copier``: the connector's copier (``detect_layout`` on CUDA
   tensors) against the same reference;
3. ``ipc-round-trip`` and 4. ``handle-cleanup``: CUDA IPC between
   processes through the sidecar's own code (:mod:`kvstrata.testing.gpuipc`:
   the production ``CudaDevice`` path, both copy paths, the workers on the
   node's last GPU, the event wait shown to have waited);
5. ``killed-peer``: a worker SIGKILLed while the sidecar waits for its
   event (:mod:`kvstrata.testing.gpupeers`);
   and ``connector-stream``: host-mode loads on the connector's own stream
   under concurrent compute, the whole load before compute (:mod:`kvstrata.testing.gpuconnector`);
6. ``bench``: ``kvstrata bench transfer`` (printed as JSON).

The workers run in one PID namespace with this process, as the
operator's Pods run them (``shareProcessNamespace: true``);
``--pid-namespace separate`` (root) gives each its own, as a Pod without it
(:mod:`kvstrata.testing.pidns`).

Each check prints ``PASS`` or ``FAIL`` with what it saw; the exit code is
0 when all pass, 1 when one fails, 2 when the checks cannot run here (one
line says why: "no CUDA device: ...", or torch missing; the checks build
vLLM-like KV with torch, which the sidecar's own code never needs).
``--json`` prints one JSON object instead.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from kvstrata.testing.gpuipc import CheckFailed

CHUNKS, PER_CHUNK, SKIP = 3, 4, (0, 4, 10)
POISON_KV = 0x5A  # a scatter target's KV before the copy


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("what", choices=["gpu"], help="what to check (gpu: the CUDA path)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true", help="the benchmark's smaller sizes")
    parser.add_argument("--no-bench", action="store_true", help="skip the transfer benchmark")
    parser.add_argument(
        "--pid-namespace",
        choices=["pod", "separate"],
        default=None,
        help="where the worker processes run: pod (default; one PID namespace, as the "
        "operator's Pods share theirs) or separate (each its own, root only: as a Pod "
        "without shareProcessNamespace, where CUDA IPC cannot work)",
    )


@dataclass
class CheckResult:
    name: str
    ok: bool
    detail: str
    seconds: float


def cannot_run_reason() -> str | None:
    """The line saying why this machine cannot run the GPU checks, starting with
    "no CUDA device: " when that is why (None: torch sees a CUDA device)."""
    try:
        import torch
    except ImportError as exc:
        return f"cannot run: torch is not importable ({exc}); the checks build their KV with torch"
    from kvstrata.sidecar.transfer import kernels

    if torch.cuda.is_available():
        return None
    if torch.version.cuda is None:
        seen = f"torch {torch.__version__} is built without CUDA"
    else:
        seen = f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no device"
    return f"no CUDA device: {seen}; csrc kernels: {kernels.cuda_unavailable_reason() or 'loaded'}"


def cuda_library() -> Any:
    """The csrc CUDA library; CheckFailed naming why it cannot run where torch sees a GPU."""
    from kvstrata.sidecar.transfer import kernels

    lib = kernels.load_cuda()
    if lib is None:
        raise CheckFailed(f"torch sees a GPU but the csrc kernels do not: "
                          f"{kernels.cuda_unavailable_reason()}")  # fmt: skip
    return lib


# -- 1. kernels -----------------------------------------------------------------


def _plan(layers: list[Any], block_dim: int) -> Any:
    from kvstrata.sidecar.transfer.plan import TensorGeometry, plan_from_geometry

    return plan_from_geometry([TensorGeometry.of(t) for t in layers], block_dim).coalesced()


def _every_case(dtype: Any, device: str) -> list[Any]:
    from kvstrata.testing import chunkref, kvlayouts

    cases = kvlayouts.every_case(dtype, device=device)
    return [*cases, chunkref.padded_unaligned_layers(dtype, device=device, seed=3)]


def _chunk_memory(device: str) -> tuple[tuple[str, bool], ...]:
    """(device, pinned) of the chunk buffers: device and pinned host memory on CUDA."""
    return (("cuda", False), ("cpu", True)) if device == "cuda" else (("cpu", False),)


def _side_stream(device: str) -> Any:
    """A stream of its own after everything queued so far (0 on the CPU)."""
    import torch

    if device != "cuda":
        return 0
    torch.cuda.synchronize()  # the KV was written on the default stream
    return torch.cuda.Stream()


def _kernel_gather_ok(
    lib: Any, case: Any, memory: tuple[str, bool], chunks: int, per_chunk: int
) -> bool:
    import torch

    from kvstrata.testing import chunkref

    plan = _plan(list(case.layers.values()), case.block_dim)
    ids = chunkref.random_block_ids(case.num_blocks, chunks * per_chunk, seed=2, skip=SKIP)
    arena = chunkref.ChunkArena(
        chunks, plan.chunk_nbytes(per_chunk), device=memory[0], pinned=memory[1]
    )
    stream = _side_stream(case_device(case))
    lib.gather(plan, ids, arena.addresses, per_chunk, stream=stream)
    lib.synchronize(stream)
    want = [
        chunkref.chunk_bytes(case, ids[c * per_chunk : (c + 1) * per_chunk], chunkref.POISON)
        for c in range(chunks)
    ]
    return torch.equal(arena.buf.cpu(), arena.expected_after_gather([w.cpu() for w in want]).cpu())


def case_device(case: Any) -> str:
    return next(iter(case.layers.values())).device.type


def _kernel_scatter_ok(lib: Any, case: Any, memory: tuple[str, bool]) -> bool:
    import torch

    from kvstrata.testing import chunkref

    layers = list(case.layers.values())
    target = chunkref.clone_layers(layers)
    for raw in chunkref.storage_bytes(target):
        raw.fill_(POISON_KV)
    plan = _plan(target, case.block_dim)
    src = chunkref.random_block_ids(case.num_blocks, CHUNKS * PER_CHUNK, seed=5)
    dst = chunkref.random_block_ids(case.num_blocks, CHUNKS * PER_CHUNK, seed=6, skip=SKIP)
    arena = chunkref.ChunkArena(
        CHUNKS, plan.chunk_nbytes(PER_CHUNK), device=memory[0], pinned=memory[1]
    )
    expected = chunkref.clone_layers(target)
    for c in range(CHUNKS):
        part = slice(c * PER_CHUNK, (c + 1) * PER_CHUNK)
        data = chunkref.chunk_bytes(case, src[part], chunkref.POISON)
        arena.chunk(c).copy_(data)
        chunkref.scatter_reference(case, expected, dst[part], data)
    stream = _side_stream(case_device(case))
    lib.scatter(plan, dst, arena.addresses, PER_CHUNK, stream=stream)
    lib.synchronize(stream)
    got, want = chunkref.storage_bytes(target), chunkref.storage_bytes(expected)
    return all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def check_kernels(lib: Any = None, device: str = "cuda") -> str:
    """The csrc kernels against the torch reference (see the module docstring).

    ``lib`` defaults to the CUDA library; the CPU tests pass the host library
    and ``device="cpu"`` to run this same check without a GPU.
    """
    from kvstrata.testing.kvlayouts import DTYPES, vllm_layers

    lib = lib or cuda_library()
    failures: list[str] = []
    runs = 0
    for dtype in DTYPES:
        for case in _every_case(dtype, device):
            for memory in _chunk_memory(device):
                where = f"{case.name} with chunks in {_memory_name(memory)} memory"
                runs += 1
                if not _kernel_gather_ok(lib, case, memory, CHUNKS, PER_CHUNK):
                    failures.append(f"gather {where}")
                if not _kernel_scatter_ok(lib, case, memory):
                    failures.append(f"scatter {where}")
    # 48 chunks of 16 blocks: more ids than the kernel parameters hold (device scratch).
    large = vllm_layers("LBNHC", num_layers=4, num_blocks=1024, device=device, seed=10)
    for memory in _chunk_memory(device):
        runs += 1
        if not _kernel_gather_ok(lib, large, memory, 48, 16):
            failures.append(f"gather of 48 chunks x 16 blocks into {_memory_name(memory)} memory")
    if failures:
        raise CheckFailed(f"{len(failures)} copies differ: {', '.join(failures[:6])}")
    return f"{runs} layout x dtype x chunk-memory cases, gather and scatter byte-exact"


def _memory_name(memory: tuple[str, bool]) -> str:
    return "pinned host" if memory[1] else "device" if memory[0] == "cuda" else "host"


# -- 2. the connector's torch copier --------------------------------------------


def check_torch_copier(device: str = "cuda") -> str:
    """The connector's copier on ``device`` tensors against the torch reference."""
    import torch

    from kvstrata.connector.layout import detect_layout
    from kvstrata.testing import chunkref
    from kvstrata.testing.kvlayouts import DTYPES, every_case, layout_to_check

    failures: list[str] = []
    runs = 0
    for dtype in DTYPES:
        for case in every_case(dtype, device=device):
            layout = detect_layout(
                case.layers, kv_cache_layout=layout_to_check(case.kv_cache_layout),
                blocks_per_chunk=PER_CHUNK, block_dim=case.block_dim,
            )  # fmt: skip
            src = chunkref.random_block_ids(case.num_blocks, PER_CHUNK, seed=7)
            dst = chunkref.random_block_ids(case.num_blocks, PER_CHUNK, seed=8)
            want = chunkref.chunk_bytes(case, src, chunkref.POISON).cpu()
            for memory in _chunk_memory(device):
                runs += 1
                where = f"{case.name} ({_memory_name(memory)} chunk)"
                buf = torch.full(
                    (layout.chunk_nbytes,), chunkref.POISON, dtype=torch.uint8, device=memory[0],
                    pin_memory=memory[1],
                )  # fmt: skip
                layout.gather(src, buf)
                _synchronize(device)
                if not torch.equal(buf.cpu(), want):
                    failures.append(f"gather {where}")
                target = chunkref.clone_layers(list(case.layers.values()))
                for raw in chunkref.storage_bytes(target):
                    raw.fill_(POISON_KV)
                expected = chunkref.clone_layers(target)
                chunkref.scatter_reference(case, expected, dst, want.to(device))
                target_layout = detect_layout(
                    dict(zip(case.layers, target, strict=True)),
                    kv_cache_layout=layout_to_check(case.kv_cache_layout),
                    blocks_per_chunk=PER_CHUNK, block_dim=case.block_dim,
                )  # fmt: skip
                target_layout.scatter(buf, dst)
                _synchronize(device)
                got, exp = chunkref.storage_bytes(target), chunkref.storage_bytes(expected)
                if not all(torch.equal(g, e) for g, e in zip(got, exp, strict=True)):
                    failures.append(f"scatter {where}")
    if failures:
        raise CheckFailed(f"{len(failures)} copies differ: {', '.join(failures[:6])}")
    return f"{runs} layout x dtype x chunk-memory cases, gather and scatter byte-exact"


def _synchronize(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


# -- 3, 4. CUDA IPC between processes --------------------------------------------------


def check_ipc_round_trip() -> str:
    from kvstrata.testing import gpuipc

    return gpuipc.check_ipc_round_trip(cuda_library())


def check_handle_cleanup() -> str:
    from kvstrata.testing import gpuipc

    return gpuipc.check_handle_cleanup(cuda_library())


def check_connector_stream() -> str:
    from kvstrata.testing import gpuconnector

    return gpuconnector.check_connector_stream()


def check_killed_peer() -> str:
    from kvstrata.testing import gpupeers

    return gpupeers.check_killed_peer(cuda_library())


CHECKS: dict[str, Callable[[], str]] = {
    "kernels": check_kernels,
    "torch-copier": check_torch_copier,
    "connector-stream": check_connector_stream,
    "ipc-round-trip": check_ipc_round_trip,
    "handle-cleanup": check_handle_cleanup,
    "killed-peer": check_killed_peer,
}


def run_check(name: str, check: Callable[[], str]) -> CheckResult:
    """Run one check; a CheckFailed or any other exception is a FAIL with its reason."""
    started = time.monotonic()
    try:
        detail, ok = check(), True
    except CheckFailed as exc:
        detail, ok = str(exc), False
    except Exception:  # a crash of the check is a failure to report, not to hide
        detail, ok = traceback.format_exc().rstrip(), False
    return CheckResult(name, ok, detail, round(time.monotonic() - started, 2))


def _bench(quick: bool) -> dict[str, Any]:
    from kvstrata.bench import transfer
    from kvstrata.bench.machine import machine_info

    return {"machine": machine_info(), **transfer.run(argparse.Namespace(quick=quick))}


def _line(result: CheckResult) -> str:
    verdict = "PASS" if result.ok else "FAIL"
    return f"{verdict} {result.name} ({result.seconds:.1f} s): {result.detail}"


def run(args: argparse.Namespace) -> int:
    if getattr(args, "pid_namespace", None):
        from kvstrata.testing import pidns

        os.environ[pidns.ENV] = args.pid_namespace  # the spawned checks read it
    line = cannot_run_reason()
    if line is not None:
        print(
            json.dumps({"selftest": args.what, "ok": False, "skipped": line}) if args.json else line
        )
        return 2
    # The sidecar code under test logs why a copy failed; show it beside the verdicts.
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    results = []
    for name, check in CHECKS.items():
        results.append(run_check(name, check))
        if not args.json:
            print(_line(results[-1]), flush=True)
    bench: dict[str, Any] | None = None
    if not args.no_bench:
        started = time.monotonic()
        try:
            bench = _bench(bool(args.quick))
            ok, detail = True, "kvstrata bench transfer figures follow"
        except Exception:
            ok, detail = False, traceback.format_exc().rstrip()
        results.append(CheckResult("bench", ok, detail, round(time.monotonic() - started, 2)))
        if not args.json:
            print(_line(results[-1]))
            if bench is not None:
                print(json.dumps(bench, indent=2, default=str))
    ok = all(r.ok for r in results)
    if args.json:
        record: dict[str, Any] = {
            "selftest": args.what,
            "ok": ok,
            "checks": [asdict(r) for r in results],
        }
        if bench is not None:
            record["bench"] = bench
        print(json.dumps(record, indent=2, default=str))
    sys.stdout.flush()
    return 0 if ok else 1
