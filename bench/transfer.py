"""``kvstrata bench transfer``: paged KV <-> chunk buffers, against a plain copy.

Shape: an 8B-like model (32 layers, 8 KV heads, head dim 128, bf16, block
size 16, 256-token chunks: 32 MiB a chunk), laid out as vLLM does on GPUs
(``LBNHC``, the per-layer default, and ``BLNHC``, cross-layer blocks).
Each figure is the median of ``reps`` timed repetitions after a warm-up,
over ``chunks`` chunks whose block ids are shuffled (vLLM's free list).

* ``store``: paged blocks -> chunk buffers in pinned host memory;
  ``load``: the reverse.
* paths: ``torch`` (the connector's copier: one copy per run of
  consecutive blocks over every layer when the layers are cut from one
  buffer, else one per layer and run), ``torch-per-layer`` (the same
  copier with one copy per layer and run: what KV of separate per-layer
  allocations takes, and what every layout took before), ``kernel`` (the
  csrc library: all layers and chunks in one launch; on CUDA straight into
  pinned host memory, "zero-copy"),
  ``kernel-staging`` (CUDA: into a device buffer, then one
  ``cudaMemcpyAsync`` to pinned host memory), ``ipc`` (CUDA: the sidecar's
  own path: another process owns the KV and exports it over CUDA IPC; this
  one maps it and copies with :class:`CudaDevice` into a shared-memory
  arena it registered, waiting for the owner's event on every store and
  synchronising its stream after every call, as SAVE_BLOCKS / LOAD_BLOCKS
  do; ``ipc_error`` says why where it could not run).
* ``dma-batch`` (CUDA): vLLM's own OffloadingConnector transfer
  (``vllm/v1/kv_offload/cpu/gpu_worker.py``: ``swap_blocks_batch``), one
  ``cudaMemcpyBatchAsync`` per transfer with one entry per page run (layer
  x block x segment) between the paged KV and the pinned chunks, on a side
  stream; loads let the copy engines read the host side out of stream
  order, as vLLM's do. Its descriptors are built once, outside the timing.
* baseline, in the same run: one plain copy of the same number of bytes
  between one contiguous buffer on the KV's device and pinned host memory
  (CUDA: ``cudaMemcpyAsync``; CPU: memcpy). Ratio = path GB/s / baseline GB/s.
* ``--param paths=a,b``: measure only these paths (the baseline always). On
  a machine without CUDA the GPU paths (:data:`GPU_PATHS`) are refused by
  name, and a run of every path says in ``not_measured`` which it left out.
* CUDA only, ``matmul_slowdown``: how much longer a bf16 matmul loop takes
  while stores and loads run beside it on another stream (the ``kernel``
  path); ``matmul_slowdown_by_path`` the same for each measured path (what
  each copy path costs vLLM's forward pass beside it).

Without a GPU it runs on the CPU (torch and the host build of the kernels).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

LAYERS, HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
CHUNK_TOKENS = 256
TARGET_VS_MEMCPY = 0.95
CPU_PATHS = ("torch", "torch-per-layer", "kernel")
GPU_PATHS = ("kernel-staging", "ipc", "dma-batch")


def plan_from(args: argparse.Namespace) -> tuple[str, ...]:
    """``--param`` checked before the benchmark starts (``kvstrata bench``'s
    argument check): the paths this machine would measure, or SystemExit."""
    import torch

    return wanted_paths(args, torch.cuda.is_available())


def wanted_paths(args: argparse.Namespace, cuda: bool) -> tuple[str, ...]:
    """The paths to measure (``--param paths=...``, default every one this machine
    runs). SystemExit naming the problem for an unknown path or setting, or for a
    GPU path asked for without a CUDA device."""
    asked: tuple[str, ...] | None = None
    for item in getattr(args, "param", None) or []:
        key, _, value = item.partition("=")
        if key != "paths":
            raise SystemExit(f"kvstrata bench transfer: unknown --param {key!r} (known: paths)")
        asked = tuple(p.strip() for p in value.split(",") if p.strip())
        unknown = [p for p in asked if p not in CPU_PATHS + GPU_PATHS]
        if unknown or not asked:
            raise SystemExit(
                f"kvstrata bench transfer: paths {unknown or asked} unknown; "
                f"known: {', '.join(CPU_PATHS + GPU_PATHS)}"
            )
    if asked is None:
        return CPU_PATHS + GPU_PATHS if cuda else CPU_PATHS
    gpu_only = [p for p in asked if p in GPU_PATHS]
    if gpu_only and not cuda:
        raise SystemExit(
            f"kvstrata bench transfer: {', '.join(gpu_only)} need a CUDA device, and torch "
            "sees none here; run them on a GPU machine (make gpu-kit)"
        )
    return asked


def _params(quick: bool, cuda: bool) -> dict[str, Any]:
    chunks = (2 if quick else 8) if cuda else (1 if quick else 2)
    return {"chunks": chunks, "reps": 3 if quick else 7}


def _timed(fn: Callable[[], None], sync: Callable[[], None], reps: int) -> float:
    fn()
    sync()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _case(layout: str, num_blocks: int, device: str) -> Any:
    import torch

    from kvstrata.connector.layout import detect_layout
    from kvstrata.testing.kvlayouts import layout_to_check, vllm_layers

    case = vllm_layers(
        layout,
        num_layers=LAYERS,
        num_blocks=num_blocks,
        heads=HEADS,
        tokens=BLOCK,
        content=2 * HEAD_DIM,
        dtype=torch.bfloat16,
        device=device,
    )
    return detect_layout(
        case.layers,
        kv_cache_layout=layout_to_check(layout),
        blocks_per_chunk=CHUNK_TOKENS // BLOCK,
        block_dim=0,
    )


@dataclass
class _LayoutRun:
    """One layout's paged KV, the chunks to move and their pinned host buffers."""

    layout: Any  # the connector's ChunkLayout: copier, transfer plan, chunk size
    device: str
    num_blocks: int
    store_ids: list[int]  # shuffled block ids, ``per_chunk`` for each chunk
    host: Any  # pinned (on CUDA) host memory of every chunk, one after the other
    chunk_bufs: list[Any]  # ``host`` cut into the chunks
    reps: int
    sync: Callable[[], None]  # waits for the device (a no-op on the CPU)

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    @property
    def per_chunk(self) -> int:
        return CHUNK_TOKENS // BLOCK

    @property
    def total(self) -> int:
        return int(self.layout.chunk_nbytes * len(self.chunk_bufs))

    def gbps(self, fn: Callable[[], None]) -> float:
        """GB/s of moving every chunk once with ``fn`` (median of ``reps``)."""
        return self.total / _timed(fn, self.sync, self.reps) / 1e9

    def addresses(self) -> list[int]:
        # Pinned host memory from cudaHostAlloc is mapped at the same address
        # for the device (unified virtual addressing on every 64-bit platform).
        return [b.data_ptr() for b in self.chunk_bufs]


def _layout_run(layout_name: str, params: dict[str, Any], device: str) -> _LayoutRun:
    import torch

    per_chunk = CHUNK_TOKENS // BLOCK
    chunks = params["chunks"]
    num_blocks = chunks * per_chunk * 2  # room to load into other blocks
    layout = _case(layout_name, num_blocks, device)
    nbytes = layout.chunk_nbytes
    ids = list(range(num_blocks))
    random.Random(0).shuffle(ids)
    host = torch.empty(nbytes * chunks, dtype=torch.uint8, pin_memory=device == "cuda")
    return _LayoutRun(
        layout=layout,
        device=device,
        num_blocks=num_blocks,
        store_ids=ids[: chunks * per_chunk],
        host=host,
        chunk_bufs=[host[c * nbytes : (c + 1) * nbytes] for c in range(chunks)],
        reps=params["reps"],
        sync=torch.cuda.synchronize if device == "cuda" else (lambda: None),
    )


def _measure_layout(
    layout_name: str, params: dict[str, Any], device: str, paths: tuple[str, ...]
) -> dict[str, Any]:
    from kvstrata.sidecar.transfer import kernels

    run = _layout_run(layout_name, params, device)
    rows = {"baseline": _baseline_row(run)}
    if "torch" in paths:
        rows["torch"] = _torch_row(run, run.layout.copier)
    if "torch-per-layer" in paths:
        from kvstrata.sidecar.transfer.torch_copy import TorchCopier

        per_layer = TorchCopier(run.layout.plan, run.layout.layers, stack_layers=False)
        rows["torch-per-layer"] = _torch_row(run, per_layer)
    lib = kernels.load_cuda() if run.cuda else kernels.load_host()
    if lib is not None:
        rows.update({k: v for k, v in _kernel_rows(run, lib, paths).items() if k in paths})
    errors: dict[str, str] = {}
    if run.cuda and lib is not None and "dma-batch" in paths:
        try:
            rows["dma-batch"] = _dma_batch_row(run, lib)
        except Exception as exc:  # e.g. a runtime before CUDA 12.8: said, not fatal
            errors["dma-batch"] = f"{type(exc).__name__}: {exc}"
    ipc_error: str | None = None
    if run.cuda and lib is not None and "ipc" in paths:
        try:
            rows["ipc"] = _measure_ipc(
                lib,
                layout_name,
                run.num_blocks,
                run.store_ids,
                run.layout.chunk_nbytes,
                len(run.chunk_bufs),
                run.reps,
            )
        except Exception as exc:  # reported beside the figures, not fatal to them
            ipc_error = f"{type(exc).__name__}: {exc}"
    for name, row in rows.items():
        if name != "baseline":
            row["store_vs_baseline"] = row["store_gbps"] / rows["baseline"]["store_gbps"]
            row["load_vs_baseline"] = row["load_gbps"] / rows["baseline"]["load_gbps"]
    out: dict[str, Any] = {
        "chunk_bytes": run.layout.chunk_nbytes,
        "chunks": len(run.chunk_bufs),
        "paths": rows,
    }
    if ipc_error is not None:
        out["ipc_error"] = ipc_error
    if errors:
        out["errors"] = errors
    if run.cuda and lib is not None:
        out["matmul_slowdown"] = _matmul_slowdown(_side_transfer(run, lib), run.reps)
        out["matmul_slowdown_by_path"], slowdown_errors = _slowdowns(run, lib, paths)
        if slowdown_errors:
            out.setdefault("errors", {}).update(slowdown_errors)
    return out


def _slowdowns(
    run: _LayoutRun, lib: Any, paths: tuple[str, ...]
) -> tuple[dict[str, float], dict[str, str]]:
    """:func:`_matmul_slowdown` of each measured path's store and load of every
    chunk: what each copy path costs a forward pass running beside it. A path
    that fails here is reported by name, not fatal to the others."""
    figures: dict[str, float] = {}
    errors: dict[str, str] = {}
    for name, transfer in _side_transfers(run, lib, paths).items():
        try:
            figures[name] = _matmul_slowdown(transfer, run.reps)
        except Exception as exc:  # e.g. no batched DMA before CUDA 12.8
            errors[f"matmul_slowdown/{name}"] = f"{type(exc).__name__}: {exc}"
    return figures, errors


def _side_transfers(
    run: _LayoutRun, lib: Any, paths: tuple[str, ...]
) -> dict[str, Callable[[], None]]:
    """Per path, a store and a load of every chunk (the copies its row times) on
    the stream current when called (the side stream :func:`_matmul_slowdown` sets)."""
    import torch

    transfers: dict[str, Callable[[], None]] = {"kernel": _side_transfer(run, lib)}
    pairs: dict[str, tuple[Callable[[], None], Callable[[], None]]] = {}
    if "torch" in paths:
        pairs["torch"] = _chunk_copies(run, run.layout.copier)
    if "kernel-staging" in paths:
        pairs["kernel-staging"] = _staged_copies(run, lib)
    if "dma-batch" in paths:
        kv, chunks, sizes = _dma_arrays(run)

        def batch_store() -> None:
            lib.memcpy_batch_async(chunks, kv, sizes, torch.cuda.current_stream().cuda_stream)

        def batch_load() -> None:
            stream = torch.cuda.current_stream().cuda_stream
            lib.memcpy_batch_async(kv, chunks, sizes, stream, src_access_any=True)

        pairs["dma-batch"] = (batch_store, batch_load)
    for name, (store, load) in pairs.items():
        transfers[name] = _in_turn(store, load)
    return transfers


def _in_turn(*steps: Callable[[], None]) -> Callable[[], None]:
    """One call running ``steps`` one after the other."""

    def run_steps() -> None:
        for step in steps:
            step()

    return run_steps


def _baseline_row(run: _LayoutRun) -> dict[str, float]:
    """One plain copy of the same bytes, device buffer <-> pinned host."""
    import torch

    flat = torch.empty(run.total, dtype=torch.uint8, device=run.device)
    return {
        "store_gbps": run.gbps(lambda: run.host.copy_(flat, non_blocking=True)),
        "load_gbps": run.gbps(lambda: flat.copy_(run.host, non_blocking=True)),
    }


def _torch_row(run: _LayoutRun, copier: Any) -> dict[str, float]:
    """A torch copier (the connector's, or one copying layer by layer), chunk by chunk."""
    store, load = _chunk_copies(run, copier)
    return {"store_gbps": run.gbps(store), "load_gbps": run.gbps(load)}


def _chunk_copies(run: _LayoutRun, copier: Any) -> tuple[Callable[[], None], Callable[[], None]]:
    """(store, load) of every chunk through a torch copier, chunk by chunk."""
    per_chunk = run.per_chunk

    def by_chunk(op: Callable[[list[int], Any], None]) -> Callable[[], None]:
        def each() -> None:
            for c, buf in enumerate(run.chunk_bufs):
                op(run.store_ids[c * per_chunk : (c + 1) * per_chunk], buf)

        return each

    return (
        by_chunk(lambda b, buf: copier.gather(b, buf)),
        by_chunk(lambda b, buf: copier.scatter(buf, b)),
    )


def _kernel_rows(run: _LayoutRun, lib: Any, paths: tuple[str, ...]) -> dict[str, dict[str, float]]:
    """The csrc kernels straight into the host buffers and, on CUDA, through a
    device staging buffer and one copy."""
    import torch

    plan, ids, per_chunk = run.layout.plan, run.store_ids, run.per_chunk
    addresses = run.addresses()
    stream = torch.cuda.current_stream() if run.cuda else 0
    rows: dict[str, dict[str, float]] = {}
    if "kernel" in paths:
        rows["kernel"] = {
            "store_gbps": run.gbps(lambda: lib.gather(plan, ids, addresses, per_chunk, stream)),
            "load_gbps": run.gbps(lambda: lib.scatter(plan, ids, addresses, per_chunk, stream)),
        }
    if run.cuda and "kernel-staging" in paths:
        staged_store, staged_load = _staged_copies(run, lib)
        rows["kernel-staging"] = {
            "store_gbps": run.gbps(staged_store),
            "load_gbps": run.gbps(staged_load),
        }
    return rows


def _staged_copies(run: _LayoutRun, lib: Any) -> tuple[Callable[[], None], Callable[[], None]]:
    """(store, load) of every chunk through a device staging buffer and one copy,
    on the stream current when called."""
    import torch

    plan, ids, per_chunk = run.layout.plan, run.store_ids, run.per_chunk
    nbytes = run.layout.chunk_nbytes
    staging = torch.empty(run.total, dtype=torch.uint8, device=run.device)
    stage_addr = [staging.data_ptr() + c * nbytes for c in range(len(run.chunk_bufs))]

    def staged_store() -> None:
        lib.gather(plan, ids, stage_addr, per_chunk, torch.cuda.current_stream())
        run.host.copy_(staging, non_blocking=True)

    def staged_load() -> None:
        staging.copy_(run.host, non_blocking=True)
        lib.scatter(plan, ids, stage_addr, per_chunk, torch.cuda.current_stream())

    return staged_store, staged_load


def dma_descriptors(
    plan: Any, block_ids: list[int], chunk_addresses: list[int], per_chunk: int
) -> tuple[list[int], list[int], list[int]]:
    """``(kv_addresses, chunk_addresses, sizes)``: one copy per page run (layer x
    block x segment of the plan), as vLLM's batched DMA describes a transfer,
    the chunk side in the plan's chunk byte order."""
    kv, chunks, sizes = [], [], []
    for c, base in enumerate(chunk_addresses):
        for position in range(per_chunk):
            block = block_ids[c * per_chunk + position]
            for layer in range(plan.num_layers):
                for segment in range(plan.num_segments):
                    kv.append(plan.source_address(layer, block, segment))
                    chunks.append(base + plan.chunk_offset(layer, position, segment, per_chunk))
                    sizes.append(plan.segment_bytes)
    return kv, chunks, sizes


def _dma_batch_row(run: _LayoutRun, lib: Any) -> dict[str, float]:
    """vLLM's batched DMA on the same blocks (see the module docstring)."""
    import torch

    kv, chunks, sizes = _dma_arrays(run)
    side = torch.cuda.Stream()  # a batch may not go on the legacy default stream
    stream = side.cuda_stream
    # The same bytes as the csrc kernel's gather, or the figure is of another transfer.
    run.host.fill_(0x5A)
    lib.memcpy_batch_async(chunks, kv, sizes, stream)
    run.sync()
    by_dma = run.host.clone()
    lib.gather(run.layout.plan, run.store_ids, run.addresses(), run.per_chunk, stream)
    run.sync()
    if not torch.equal(by_dma, run.host):
        raise RuntimeError("the batched DMA wrote other chunk bytes than the csrc kernel")
    return {
        "store_gbps": run.gbps(lambda: lib.memcpy_batch_async(chunks, kv, sizes, stream)),
        "load_gbps": run.gbps(
            lambda: lib.memcpy_batch_async(kv, chunks, sizes, stream, src_access_any=True)
        ),
        "copies_per_call": len(sizes),
    }


def _dma_arrays(run: _LayoutRun) -> tuple[Any, Any, Any]:
    """:func:`dma_descriptors` of the run's blocks as the uint64 arrays the batch takes."""
    import numpy as np

    descriptors = dma_descriptors(run.layout.plan, run.store_ids, run.addresses(), run.per_chunk)
    kv, chunks, sizes = (np.asarray(a, dtype=np.uint64) for a in descriptors)
    return kv, chunks, sizes


def _side_transfer(run: _LayoutRun, lib: Any) -> Callable[[], None]:
    """A store and a load of every chunk on the caller's (side) stream."""
    import torch

    addresses = run.addresses()

    def transfer() -> None:
        side = torch.cuda.current_stream()
        lib.gather(run.layout.plan, run.store_ids, addresses, run.per_chunk, side)
        lib.scatter(run.layout.plan, run.store_ids, addresses, run.per_chunk, side)

    return transfer


def _measure_ipc(
    lib: Any, layout_name: str, num_blocks: int, ids: list[int], nbytes: int, chunks: int, reps: int
) -> dict[str, float]:
    """Store and load GB/s of the sidecar's ipc path (see the module docstring);
    ``nbytes``: a chunk's size, as the connector's plan of the same shape says."""
    from kvstrata.sidecar.arena import Arena
    from kvstrata.sidecar.transfer.cuda_device import CudaDevice
    from kvstrata.sidecar.transfer.plan import TensorGeometry, plan_from_geometry
    from kvstrata.testing.gpuipc import exported_kv

    per_chunk = CHUNK_TOKENS // BLOCK
    shape = {
        "num_layers": LAYERS, "num_blocks": num_blocks, "heads": HEADS, "tokens": BLOCK,
        "content": 2 * HEAD_DIM,
    }  # fmt: skip
    total = nbytes * chunks
    with exported_kv(layout_name, "bfloat16", shape) as (kv, event), Arena(total) as arena:
        device = CudaDevice(lib, kv.uuid, arena)
        try:
            base = device.open_memory(kv.handle)
            try:
                layers = zip(kv.offsets, kv.shapes, kv.strides, strict=True)
                geometries = [TensorGeometry(base + o, sh, st, kv.itemsize) for o, sh, st in layers]
                plan = plan_from_geometry(geometries, 0).coalesced()
                if plan.chunk_nbytes(per_chunk) != nbytes:
                    raise ValueError(
                        f"exported KV makes {plan.chunk_nbytes(per_chunk)}-byte chunks"
                    )
                addresses = [device.arena_address(c * nbytes) for c in range(chunks)]

                def store() -> None:
                    device.gather(plan, ids, addresses, per_chunk, event)

                def load() -> None:
                    device.scatter(plan, ids, addresses, per_chunk)

                # Every call is synchronous, as the sidecar's are: nothing more to wait for.
                return {
                    "store_gbps": total / _timed(store, lambda: None, reps) / 1e9,
                    "load_gbps": total / _timed(load, lambda: None, reps) / 1e9,
                }
            finally:
                device.close_memory(base)  # before the exporting process exits
        finally:
            device.close()  # unregisters the arena before it is unmapped


def _matmul_slowdown(transfer: Callable[[], None], reps: int) -> float:
    """Time of a matmul loop while transfers run on another stream / time alone."""
    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)

    def matmuls() -> None:
        for _ in range(20):
            a @ a

    alone = _timed(matmuls, torch.cuda.synchronize, reps)
    side = torch.cuda.Stream()

    def both() -> None:
        with torch.cuda.stream(side):
            transfer()
        matmuls()

    together = _timed(both, torch.cuda.synchronize, reps)
    return together / alone


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    paths = wanted_paths(args, cuda)
    params = _params(bool(getattr(args, "quick", False)), cuda)
    layouts = {name: _measure_layout(name, params, device, paths) for name in ("LBNHC", "BLNHC")}
    return {
        "device": device,
        "paths": list(paths),
        "not_measured": {} if cuda else {p: "needs a CUDA device" for p in GPU_PATHS},
        "shape": {
            "layers": LAYERS,
            "kv_heads": HEADS,
            "head_dim": HEAD_DIM,
            "dtype": "bfloat16",
            "block_size": BLOCK,
            "chunk_tokens": CHUNK_TOKENS,
        },
        "params": params,
        "target_vs_baseline": TARGET_VS_MEMCPY,
        "layouts": layouts,
    }


def format_table(result: dict[str, Any]) -> str:
    lines = [
        f"transfer on {result['device']} (8B-like shape, bf16, 256-token chunks), GB/s",
        f"{'layout':8} {'path':16} {'store':>8} {'load':>8} {'store x':>8} {'load x':>8}",
    ]
    for name, layout in result["layouts"].items():
        for path, row in layout["paths"].items():
            lines.append(
                f"{name:8} {path:16} {row['store_gbps']:8.2f} {row['load_gbps']:8.2f} "
                f"{row.get('store_vs_baseline', 1.0):8.2f} {row.get('load_vs_baseline', 1.0):8.2f}"
            )
        if "ipc_error" in layout:
            lines.append(f"{name:8} ipc path not measured: {layout['ipc_error']}")
        for path, why in layout.get("errors", {}).items():
            lines.append(f"{name:8} {path} not measured: {why}")
        if "matmul_slowdown" in layout:
            lines.append(
                f"{name:8} matmul slowdown while transferring: {layout['matmul_slowdown']:.2f}x"
            )
        for path, slowdown in layout.get("matmul_slowdown_by_path", {}).items():
            lines.append(f"{name:8} matmul slowdown beside {path}: {slowdown:.2f}x")
    for path, why in result.get("not_measured", {}).items():
        lines.append(f"{path} not measured: {why}")
    return "\n".join(lines)
