"""GPU checks between processes: what ``kvstrata selftest gpu`` runs on CUDA IPC.

Two checks, each with this process playing the sidecar and spawned
processes playing vLLM workers (torch, KV tensors in vLLM's layouts):

* :func:`check_ipc_round_trip`: a worker exports its KV tensors (CUDA IPC
  memory handles, the allocation offset of each layer) and an
  interprocess event it records after the KV's last write, which is held
  back behind a GPU sleep so that a copy that did not wait for the event
  reads the poison underneath. The sidecar side registers them with the
  real :class:`~kvstrata.sidecar.transfer.ipc.IpcTransfers` over a real
  engine (arena pinned by torch, as ``l1.pin_memory`` does) and
  :class:`~kvstrata.sidecar.transfer.cuda_device.CudaDevice`, saves
  chunks (SAVE_BLOCKS) and checks the arena's bytes against
  :mod:`kvstrata.testing.chunkref`. A second worker exports poisoned
  tensors; the sidecar loads the chunks into other blocks (LOAD_BLOCKS)
  and that worker checks every byte of its KV itself: store from one
  process, load into another. A CudaDevice over an unpinned arena (its own
  registration) gathers the same chunks once more.
* :func:`check_handle_cleanup`: a worker exports a large allocation, the
  sidecar side opens it, the worker is SIGKILLed, the handle is closed (as
  the sidecar does when a session's liveness socket closes); the device's
  free memory must come back within a deadline.

:func:`exported_kv` lends the same worker to ``kvstrata bench transfer``
(its ``ipc`` path): KV of the benchmark's shape in another process.

Messages between the processes are tuples over a multiprocessing pipe:
``("ready", payload)``, ``("check", src_ids, dst_ids)`` ->
``("checked", problem_or_empty)``, ``("exit",)``, ``("error", traceback)``.
The workers' side is :mod:`kvstrata.testing.gpuworker`.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import signal
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

POISON_SOURCE = 0x3C  # under the source KV until its delayed write lands
POISON_TARGET = 0x5A  # the load target's KV before the sidecar writes it
BLOCKS_PER_CHUNK, CHUNKS = 4, 3
SKIP = (0, 5)  # chunk positions the load skips (block id -1; a save names every block)
SEED = 21
# GPU time before the source KV is written (~1 s): long enough that the sidecar
# asks for the event while it is pending; the check fails, never passes
# silently, when it was not (EventWatch counts the sidecar's "not yet" answers).
SLEEP_CYCLES = 2_000_000_000
STALL_FACTOR = 30  # the killed-peer check's worker: ~30 s, far past its kill
REPLY_SECONDS = 120.0
# (vLLM layout, dtype) of the round trip: every vLLM layout, and the other dtypes once.
ROUND_TRIP_CASES: tuple[tuple[str, str], ...] = (
    ("LBHNC", "bfloat16"),
    ("LBNHC", "bfloat16"),
    ("LHBNC", "bfloat16"),
    ("BLHNC", "bfloat16"),
    ("BLNHC", "bfloat16"),
    ("BHLNC", "bfloat16"),
    ("LBNHC", "float8_e4m3fn"),
    ("BLNHC", "float32"),
)
CLEANUP_MARGIN = 64 << 20
CLEANUP_DEADLINE_SECONDS = 30.0


class CheckFailed(Exception):
    """A selftest check found a wrong result (the message says what)."""


@dataclass(frozen=True)
class ExportedKV:
    """One worker's KV tensors of one case as the sidecar learns them (REGISTER_KV)."""

    layout: str
    dtype: str
    itemsize: int
    uuid: str
    handle: bytes
    offsets: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]
    strides: tuple[tuple[int, ...], ...]


# -- the worker side (spawned processes) -------------------------------------------


def _build(layout: str, dtype_name: str, device: str, shape: dict[str, int] | None = None) -> Any:
    """The KV of one case (``shape``: vllm_layers' size arguments; default its small one)."""
    import torch

    from kvstrata.testing.kvlayouts import vllm_layers

    dtype = getattr(torch, dtype_name)
    return vllm_layers(layout, dtype=dtype, device=device, seed=SEED, **(shape or {}))


def _export(case: Any, layout: str, dtype_name: str, references: Any = None) -> ExportedKV:
    """``case``'s KV as the sidecar learns it; the IPC reference the export takes
    goes into ``references`` (an :class:`~kvstrata.connector.ipc.IpcReferences`,
    given back at the worker's end, as the connector does)."""
    import torch

    layers = list(case.layers.values())
    storage = layers[0].untyped_storage()
    # (device, handle, storage bytes, storage offset in the allocation, ref-counter
    # file, its slot, ...): the handle covers the caching allocator's whole allocation.
    shared = storage._share_cuda_()
    # The connector's own reading of torch's versioned storage handle.
    from kvstrata.connector.ipc import cuda_memory_handle

    if references is not None:
        references.take(shared[4], shared[5])

    device, handle, offset = shared[0], cuda_memory_handle(shared[1]), int(shared[3])
    itemsize = layers[0].element_size()
    return ExportedKV(
        layout=layout,
        dtype=dtype_name,
        itemsize=itemsize,
        uuid=str(torch.cuda.get_device_properties(device).uuid),
        handle=handle,
        offsets=tuple(offset + t.storage_offset() * itemsize for t in layers),
        shapes=tuple(tuple(t.shape) for t in layers),
        strides=tuple(tuple(t.stride()) for t in layers),
    )


def _expected_target(layout: str, dtype_name: str, src: list[int], dst: list[int]) -> list[Any]:
    """The target's storage bytes once the source's chunks of ``src`` landed in ``dst``,
    computed on the CPU from the seed alone (never from what the sidecar sent)."""
    from kvstrata.testing import chunkref

    source = _build(layout, dtype_name, "cpu")
    target = chunkref.clone_layers(list(source.layers.values()))
    for raw in chunkref.storage_bytes(target):
        raw.fill_(POISON_TARGET)
    for c in range(CHUNKS):
        ids = slice(c * BLOCKS_PER_CHUNK, (c + 1) * BLOCKS_PER_CHUNK)
        chunk = chunkref.chunk_bytes(source, src[ids], chunkref.POISON)
        chunkref.scatter_reference(source, target, dst[ids], chunk)
    return chunkref.storage_bytes(target)


def worker_device() -> int:
    """The GPU the workers use: the last one, so a node with several checks a
    device other than 0 (the sidecar side finds it by UUID, as in production)."""
    import torch

    return torch.cuda.device_count() - 1


@contextmanager
def _worker(
    role: str,
    cases: Sequence[tuple[str, str]] = (),
    nbytes: int = 0,
    shape: dict[str, int] | None = None,
) -> Iterator[tuple[Any, Connection]]:
    """A spawned worker and its pipe; killed on the way out if it is still there.

    It runs in the PID namespace :mod:`kvstrata.testing.pidns` chooses, on
    :func:`worker_device`."""
    from multiprocessing import spawn

    from kvstrata.testing import pidns
    from kvstrata.testing.gpuworker import worker_main

    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    args = (child, role, list(cases), nbytes, shape, worker_device())
    proc = ctx.Process(target=worker_main, args=args, daemon=True)
    with tempfile.TemporaryDirectory(prefix="kvstrata-worker-") as tmp:
        wrapper = pidns.worker_executable(pidns.mode(), Path(tmp))
        interpreter = spawn.get_executable()
        if wrapper is not None:
            ctx.set_executable(wrapper)
        try:
            proc.start()
        finally:
            ctx.set_executable(interpreter)
    child.close()
    try:
        yield proc, parent
    finally:
        if proc.is_alive():
            with suppress(OSError):  # it may be gone already
                parent.send(("exit",))
            proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(10)
        parent.close()


@contextmanager
def exported_kv(
    layout: str, dtype: str, shape: dict[str, int]
) -> Iterator[tuple[ExportedKV, bytes]]:
    """KV tensors of ``shape`` (vllm_layers' size arguments) in another process, as
    that process exports them: its allocation handle and layer offsets, and the
    handle of an event recorded after they were written. Close every handle opened
    from it before leaving the block (the worker then exits)."""
    with _worker("export", [(layout, dtype)], shape=shape) as (_, conn):
        (kv,), event = _receive(conn, "exporting KV")
        yield kv, event


def _receive(conn: Connection, what: str) -> Any:
    if not conn.poll(REPLY_SECONDS):
        raise CheckFailed(f"no answer from the worker within {REPLY_SECONDS:.0f} s ({what})")
    message = conn.recv()
    if message[0] == "error":
        raise CheckFailed(f"the worker failed ({what}):\n{message[1]}")
    return message[1]


# -- the sidecar side (this process) ------------------------------------------------


def _registration(kv: ExportedKV) -> Any:
    from kvstrata.sidecar import protocol as p

    return p.RegisterKVRequest(
        device_uuid=kv.uuid,
        kv_cache_layout=kv.layout,
        block_dim=0,
        blocks_per_chunk=BLOCKS_PER_CHUNK,
        dtype=kv.dtype,
        itemsize=kv.itemsize,
        layers=[
            p.KVLayerHandle(kv.handle, off, shape, strides)
            for off, shape, strides in zip(kv.offsets, kv.shapes, kv.strides, strict=True)
        ],
    )


def _ids() -> tuple[list[int], list[int]]:
    from kvstrata.testing.chunkref import random_block_ids

    n = CHUNKS * BLOCKS_PER_CHUNK
    return random_block_ids(12, n, SEED + 1), random_block_ids(12, n, SEED + 2, SKIP)


def _per_chunk(ids: list[int]) -> list[list[int]]:
    return [ids[c * BLOCKS_PER_CHUNK : (c + 1) * BLOCKS_PER_CHUNK] for c in range(CHUNKS)]


def _keys(kv: ExportedKV, prompt: str = "") -> list[Any]:
    """The chunk keys of ``kv``'s saves; another ``prompt`` names other chunks (a
    store of a key the engine holds is answered as already stored)."""
    from kvstrata.sidecar.keys import ChunkKey, Namespace

    fp = Namespace(
        model="selftest", kv_dtype=kv.dtype, layout=kv.layout, chunk_size=64
    ).fingerprint()
    return [
        ChunkKey(fp + hashlib.sha256(f"{prompt}{kv.layout}/{c}".encode()).digest())
        for c in range(CHUNKS)
    ]


def _reference_chunks(kv: ExportedKV, src: list[int]) -> list[Any]:
    from kvstrata.testing import chunkref

    source = _build(kv.layout, kv.dtype, "cpu")
    return [chunkref.chunk_bytes(source, ids, chunkref.POISON) for ids in _per_chunk(src)]


def check_ipc_round_trip(lib: Any, copy_paths: Sequence[str] = ("zero_copy", "staging")) -> str:
    """See the module docstring. ``lib``: the loaded CUDA library; each of
    ``copy_paths`` (the sidecar's ``ipc.copy_path``) is checked. Raises CheckFailed."""
    import torch

    from kvstrata.sidecar.config import config_from_dict
    from kvstrata.sidecar.engine import StorageManager
    from kvstrata.sidecar.transfer.cuda_device import CudaDevices
    from kvstrata.sidecar.transfer.ipc import IpcTransfers
    from kvstrata.testing import chunkref

    src, dst = _ids()
    cases = list(ROUND_TRIP_CASES)
    with tempfile.TemporaryDirectory(prefix="kvstrata-selftest-") as tmp:
        notes = []
        for copy_path in copy_paths:
            # A fresh engine and L2 each: the keys are stored again, and a key a
            # tier already holds is answered as stored (keys name content).
            config = config_from_dict(
                {
                    "chunk_size": 64,
                    "l1": {"size_bytes": "64Mi", "pin_memory": True},
                    "l2": {"path": os.path.join(tmp, f"l2-{copy_path}"), "size_bytes": "64Mi"},
                }
            )
            engine = StorageManager(config)
            arena = torch.frombuffer(engine.arena.buffer, dtype=torch.uint8)
            arena.fill_(chunkref.POISON)  # what the positions the copies skip keep
            watch = EventWatch(lib)
            devices = CudaDevices(watch, engine.arena, copy_path=copy_path)  # type: ignore[arg-type]
            try:
                ipc = IpcTransfers(engine, devices)
                saved = _save_from_source_worker(lib, ipc, engine, arena, cases, src, watch)
                _load_into_target_worker(ipc, cases, src, dst)
                notes.append(f"{copy_path} (arena pinned by torch: {engine.arena.pinned}): {saved}")
            finally:
                del arena
                devices.close()  # unregisters before the engine unmaps the arena
                engine.close()
    return (
        f"{len(cases)} layouts x dtypes stored from one process, loaded into another, "
        f"workers on device {worker_device()}; " + "; ".join(notes)
    )


class EventWatch:
    """The CUDA library, with the sidecar's queries of a worker's event counted:
    the check knows the copy really waited (``pending`` answers > 0)."""

    def __init__(self, lib: Any) -> None:
        self._lib = lib
        self.pending = 0  # "not yet" answers
        self.waiting = threading.Event()  # set at the first of them

    def __getattr__(self, name: str) -> Any:
        return getattr(self._lib, name)

    def ipc_event_done(self, device: int, handle: bytes) -> bool:
        done = bool(self._lib.ipc_event_done(device, handle))
        if not done:
            self.pending += 1
            self.waiting.set()
        return done


def _save_from_source_worker(
    lib: Any,
    ipc: Any,
    engine: Any,
    arena: Any,
    cases: list[tuple[str, str]],
    src: Any,
    watch: EventWatch | None = None,
    prompt: str = "",
) -> str:
    """SAVE_BLOCKS from a source worker's KV for every case (the chunks of
    :func:`_keys` ``prompt``); checks the arena's bytes and, with ``watch``, that
    the first save really waited for the worker's event."""
    from kvstrata.sidecar import protocol as p

    with _worker("source", cases) as (_, conn), _sessions(ipc) as sessions:
        exported, event = _receive(conn, "exporting the source KV")
        if event is None:
            raise CheckFailed("the source worker sent no event")
        for i, kv in enumerate(exported):
            sessions.append(f"source-{i}")
            ipc.register(sessions[-1], _registration(kv))
            body = p.SaveBlocksRequest(_keys(kv, prompt), _per_chunk(src), event)
            committed = ipc.save(sessions[-1], body, "selftest").committed
            if committed != [True] * CHUNKS:
                raise CheckFailed(
                    f"{kv.layout}/{kv.dtype}: SAVE_BLOCKS committed {committed} "
                    "(the log above says why)"
                )
            if i == 0 and watch is not None:
                check_waited(watch)
            _check_arena(engine, arena, kv, src, prompt)
        return _check_own_registration(lib, exported[0], event, src)


def check_waited(watch: EventWatch) -> None:
    """CheckFailed unless the sidecar saw the worker's event pending at least once:
    otherwise the bytes were right whether or not the copy waited for it."""
    if watch.pending == 0:
        raise CheckFailed(
            "inconclusive: the worker's event had completed before the sidecar first "
            "asked, so a copy that skipped the wait would have passed too "
            "(raise gpuipc.SLEEP_CYCLES for this GPU)"
        )


def _load_into_target_worker(ipc: Any, cases: list[tuple[str, str]], src: Any, dst: Any) -> None:
    """LOAD_BLOCKS into a target worker's poisoned KV; the worker checks its bytes."""
    from kvstrata.sidecar import protocol as p

    with _worker("target", cases) as (_, conn):
        with _sessions(ipc) as sessions:
            exported, _ = _receive(conn, "exporting the target KV")
            for i, kv in enumerate(exported):
                sessions.append(f"target-{i}")
                ipc.register(sessions[-1], _registration(kv))
                body = p.LoadBlocksRequest(_keys(kv), _per_chunk(dst))
                loaded = ipc.load(sessions[-1], body, "selftest").loaded
                if loaded != CHUNKS:
                    raise CheckFailed(
                        f"{kv.layout}/{kv.dtype}: LOAD_BLOCKS loaded {loaded} of {CHUNKS}"
                    )
        # Handles closed: the worker reads its KV as vLLM would after the reply.
        conn.send(("check", src, dst))
        problem = _receive(conn, "checking the loaded KV")
        if problem:
            raise CheckFailed(f"the loading worker's KV is wrong: {problem}")


@contextmanager
def _sessions(ipc: Any) -> Iterator[list[str]]:
    """Session ids registered inside; their handles are closed on the way out, before
    the exporting worker may exit (an exporter must not free what is still mapped)."""
    sessions: list[str] = []
    try:
        yield sessions
    finally:
        for session in sessions:
            ipc.close(session)


def _check_arena(engine: Any, arena: Any, kv: ExportedKV, src: list[int], prompt: str) -> None:
    keys = _keys(kv, prompt)
    for c, (key, want) in enumerate(zip(keys, _reference_chunks(kv, src), strict=True)):
        slot = engine.acquire(key, "selftest-check")
        if slot is None:
            raise CheckFailed(f"{kv.layout}/{kv.dtype}: chunk {c} is not in L1 after SAVE_BLOCKS")
        try:
            got = arena[slot.offset : slot.offset + slot.length]
            if slot.length != want.numel() or not bool((got == want).all()):
                poisoned = int((got == POISON_SOURCE).sum())
                raise CheckFailed(
                    f"{kv.layout}/{kv.dtype}: chunk {c} differs from the reference "
                    f"({poisoned} bytes still hold the poison under the delayed write: "
                    "a copy that did not wait for the event)"
                )
        finally:
            engine.release_lease(slot.lease_id)


def _check_own_registration(lib: Any, kv: ExportedKV, event: bytes, src: list[int]) -> str:
    """A CudaDevice over an arena nothing pinned yet registers it itself and gathers right."""
    import torch

    from kvstrata.sidecar.arena import Arena
    from kvstrata.sidecar.transfer.cuda_device import CudaDevice
    from kvstrata.sidecar.transfer.plan import TensorGeometry, plan_from_geometry
    from kvstrata.testing import chunkref

    want = torch.cat(_reference_chunks(kv, src))
    arena = Arena(want.numel(), pin_memory=False)
    view = torch.frombuffer(arena.buffer, dtype=torch.uint8)
    view.fill_(chunkref.POISON)  # what the positions the copy skips keep
    try:
        device = CudaDevice(lib, kv.uuid, arena)
        try:
            base = device.open_memory(kv.handle)
            try:
                geometries = [
                    TensorGeometry(base + off, shape, strides, kv.itemsize)
                    for off, shape, strides in zip(kv.offsets, kv.shapes, kv.strides, strict=True)
                ]
                plan = plan_from_geometry(geometries, 0).coalesced()
                nbytes = plan.chunk_nbytes(BLOCKS_PER_CHUNK)
                chunks = [device.arena_address(c * nbytes) for c in range(CHUNKS)]
                device.gather(plan, src, chunks, BLOCKS_PER_CHUNK, event)
            finally:
                device.close_memory(base)
            owned = device.registration.owned
        finally:
            device.close()
        if not owned:
            raise CheckFailed("CudaDevice did not register an arena nothing had pinned")
        if not torch.equal(view, want):
            raise CheckFailed("an arena CudaDevice registered itself got other bytes")
    finally:
        del view
        arena.close()
    return "an unpinned arena registered by CudaDevice gathers the same bytes"


# -- handle cleanup ----------------------------------------------------------------


def check_handle_cleanup(lib: Any) -> str:
    """See the module docstring. Raises CheckFailed."""
    import torch

    from kvstrata.sidecar.arena import Arena
    from kvstrata.sidecar.transfer.cuda_device import CudaDevice

    uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
    arena = Arena(1 << 20, pin_memory=False)
    device = CudaDevice(lib, uuid, arena)
    try:
        torch.cuda.synchronize()
        free_before, total = lib.mem_get_info(device.index)
        nbytes = min(1 << 30, free_before // 4)
        with _worker("hog", nbytes=nbytes) as (proc, conn):
            (kv,) = _receive(conn, "exporting the allocation")
            address = device.open_memory(kv.handle)
            os.kill(proc.pid, signal.SIGKILL)  # no goodbye, as when vLLM is OOM-killed
            proc.join(30)
            held = free_before - lib.mem_get_info(device.index)[0]
            device.close_memory(address)
        deadline = time.monotonic() + CLEANUP_DEADLINE_SECONDS
        while True:
            free_now = lib.mem_get_info(device.index)[0]
            if free_now >= free_before - CLEANUP_MARGIN:
                break
            if time.monotonic() > deadline:
                raise CheckFailed(
                    f"{(free_before - free_now) >> 20} MiB of GPU memory still in use "
                    f"{CLEANUP_DEADLINE_SECONDS:.0f} s after the killed worker's handle was "
                    f"closed (allowed: {CLEANUP_MARGIN >> 20} MiB)"
                )
            time.sleep(0.1)
    finally:
        device.close()
        arena.close()
    return (
        f"{nbytes >> 20} MiB exported by a SIGKILLed worker: {held >> 20} MiB held while "
        f"mapped, back within {CLEANUP_MARGIN >> 20} MiB once closed ({total >> 30} GiB GPU)"
    )
