"""The worker's side of ipc transfer mode: share the KV, then name blocks only.

At ``register_kv_caches`` the worker exports a CUDA IPC handle for each KV
tensor's allocation (``UntypedStorage._share_cuda_``, what
``torch.multiprocessing`` uses) with the tensor's byte offset inside it,
shape and strides, and the device's UUID (the sidecar's container may
number GPUs differently). The sidecar maps them once per session; after
that a save or load is one call carrying chunk keys and block ids, and
the bytes never pass through the vLLM process.

Ordering: before a save the worker records an interprocess CUDA event on
vLLM's current stream (after the forward pass wrote the KV) and sends its
handle; the sidecar's stream waits for it. A load does the same (vLLM may
still have the previous step queued, reading or writing blocks the load
fills), and its reply comes after the sidecar's copies have finished, so
vLLM's next kernels see the blocks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from kvstrata.connector.leased_reads import STEP_OWNER
from kvstrata.connector.metadata import ChunkTransfer

if TYPE_CHECKING:
    from kvstrata.connector.client import SidecarClient
    from kvstrata.connector.metadata import RequestTransfer
from kvstrata.sidecar import protocol as p

logger = logging.getLogger(__name__)


def device_uuid(device: torch.device) -> str:
    """The GPU's UUID in nvidia-smi's form (``GPU-xxxxxxxx-...``)."""
    props = torch.cuda.get_device_properties(device)
    text = str(props.uuid)
    return text if text.startswith("GPU-") else f"GPU-{text}"


# What ``UntypedStorage._share_cuda_()[1]`` is. torch's StorageSharing.cpp
# returns the string ``c10::cuda::CUDACachingAllocator::shareIpcHandle()`` builds
# (declared in the venv's torch/include/c10/cuda/CUDACachingAllocator.h,
# ``ShareableHandle{offset, handle}``): one format-version byte
# (SHAREABLE_HANDLE_VERSION in CUDACachingAllocator.cpp), one type byte, then
# the payload. The version was 1 when the format appeared and 2 through torch
# 2.12; torch 2.13's CUDA build writes 3 (its libc10_cuda.so stores 3 before the
# type byte, and its getIpcDevPtr refuses only versions above 3) with the same
# 'c' payload as 2. The CPU wheel ships no libc10_cuda, so the byte is not
# readable here: versions above the last known one are refused, naming it.
# Type 'c' is a plain cudaMalloc segment and its payload is the 64-byte
# cudaIpcMemHandle_t; type 'e' is an expandable segment
# (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True), whose payload is a cuMem
# shareable handle that cudaIpcOpenMemHandle cannot open. Torch releases before
# the format returned the bare 64-byte handle.
SHAREABLE_HANDLE_VERSIONS = (1, 2, 3)
SHAREABLE_CUDA_MALLOC = ord("c")
SHAREABLE_CUDA_EXPANDABLE_SEGMENT = ord("e")


class IpcExportError(ValueError):
    """The KV cannot be shared by a legacy CUDA IPC handle; the message says why."""


def cuda_memory_handle(shared: bytes) -> bytes:
    """The ``cudaIpcMemHandle_t`` inside a storage handle torch exported.

    Raises :class:`IpcExportError` naming the reason for an expandable
    segment, an unknown format version or type, or a wrong length.
    """
    if not isinstance(shared, bytes):
        raise IpcExportError(f"torch exported a {type(shared).__name__}, not bytes")
    if len(shared) == p.IPC_HANDLE_BYTES:  # torch before the versioned format
        return shared
    if len(shared) < 2:
        raise IpcExportError(f"torch exported a {len(shared)}-byte storage handle")
    version, kind = shared[0], shared[1]
    if version not in SHAREABLE_HANDLE_VERSIONS:
        raise IpcExportError(
            f"torch's storage handle has format version {version}; "
            f"this connector reads {SHAREABLE_HANDLE_VERSIONS}"
        )
    if kind == SHAREABLE_CUDA_EXPANDABLE_SEGMENT:
        raise IpcExportError(
            "the KV lives in an expandable segment (PYTORCH_CUDA_ALLOC_CONF="
            "expandable_segments:True), which has no legacy CUDA IPC handle; "
            "unset expandable_segments for ipc transfer mode"
        )
    if kind != SHAREABLE_CUDA_MALLOC:
        raise IpcExportError(f"torch's storage handle has unknown type byte {kind:#04x}")
    payload = shared[2:]
    if len(payload) != p.IPC_HANDLE_BYTES:
        raise IpcExportError(
            f"a cudaMalloc storage handle carries {len(payload)} bytes, "
            f"not a {p.IPC_HANDLE_BYTES}-byte cudaIpcMemHandle_t"
        )
    return payload


class IpcReferences:
    """The IPC references this worker's exports took, to give back at its end.

    ``_share_cuda_`` (torch's ``THPStorage_shareCuda``) puts the storage
    behind a reference-counted ``CudaIPCSentData`` whose counter, a slot in a
    shared-memory file, it sets to 1 for the consumer, and returns that
    file's name and slot as items 4 and 5 of its tuple. A torch consumer
    gives it back when it drops its storage (``rebuild_cuda_tensor``, or
    ``UntypedStorage._release_ipc_counter_cuda(name, slot)``, which takes 1
    from the slot). The sidecar opens the raw handle instead and never
    does, so the worker gives its references back itself, once its sessions
    (the sidecar's mappings) have ended: with the count above 0, torch keeps
    the freed KV out of its allocator ("limbo") and warns at exit that the
    producer died with shared tensors outstanding.
    """

    def __init__(self) -> None:
        self._taken: list[tuple[bytes, int]] = []

    def take(self, counter_file: bytes, slot: int) -> None:
        """One export's reference (items 4 and 5 of ``_share_cuda_()``)."""
        self._taken.append((counter_file, slot))

    def adopt(self, other: IpcReferences) -> None:
        """Take over ``other``'s references (``other`` is left empty)."""
        self._taken += other._taken
        other._taken = []

    def taken(self) -> list[tuple[bytes, int]]:
        """The (counter file, slot) of each reference not given back yet."""
        return list(self._taken)

    def __len__(self) -> int:
        return len(self._taken)

    def release(self) -> None:
        """Give every reference back, once (later calls do nothing). Best
        effort, as torch's own release: a counter file already gone (the
        process is ending) is skipped."""
        taken, self._taken = self._taken, []
        for counter_file, slot in taken:
            try:
                torch.UntypedStorage._release_ipc_counter_cuda(counter_file, slot)
            except Exception as exc:
                logger.debug(
                    "kvstrata: IPC reference %r/%d not given back: %s", counter_file, slot, exc
                )


def kv_registration(
    tensors: Sequence[torch.Tensor],
    *,
    references: IpcReferences,
    kv_cache_layout: str | None,
    block_dim: int,
    blocks_per_chunk: int,
    num_blocks: int = 0,
    chunk_nbytes: int = 0,
) -> p.RegisterKVRequest:
    """The REGISTER_KV body for CUDA KV tensors (in model order).

    ``num_blocks``: vLLM's block count, when its kernels split each block
    into several of the tensors' (0: the tensors' own); ``chunk_nbytes``:
    the chunk size the worker's layout expects (0: not checked). Each
    export's IPC reference goes into ``references`` (the caller gives them
    back when its sessions end). Raises :class:`IpcExportError` when the
    KV cannot be shared by CUDA IPC, having given back what it took.
    """
    mine = IpcReferences()
    try:
        layers = _layer_handles(tensors, mine)
    except BaseException:
        mine.release()
        raise
    references.adopt(mine)
    first = tensors[0]
    return p.RegisterKVRequest(
        device_uuid=device_uuid(first.device),
        kv_cache_layout=kv_cache_layout or "",
        block_dim=block_dim,
        blocks_per_chunk=blocks_per_chunk,
        dtype=str(first.dtype).removeprefix("torch."),
        itemsize=first.element_size(),
        layers=layers,
        num_blocks=num_blocks,
        chunk_nbytes=chunk_nbytes,
    )


def _layer_handles(
    tensors: Sequence[torch.Tensor], references: IpcReferences
) -> list[p.KVLayerHandle]:
    layers: list[p.KVLayerHandle] = []
    # One export per allocation: vLLM often backs every layer with one storage,
    # and each _share_cuda_() takes another reference on the block it shares.
    exported: dict[int, tuple[bytes, int, int]] = {}
    for t in tensors:
        storage = t.untyped_storage()
        key = int(storage.data_ptr())
        if key not in exported:
            # (device, handle, storage size in bytes, storage offset in the
            # allocation, ref counter file, its slot, event handle, event sync)
            shared = storage._share_cuda_()
            references.take(bytes(shared[4]), int(shared[5]))
            exported[key] = (cuda_memory_handle(shared[1]), int(shared[2]), int(shared[3]))
        handle, storage_nbytes, storage_offset_bytes = exported[key]
        layers.append(
            p.KVLayerHandle(
                handle=handle,
                offset=storage_offset_bytes + t.storage_offset() * t.element_size(),
                shape=tuple(int(d) for d in t.shape),
                strides=tuple(int(s) for s in t.stride()),
                mapped_nbytes=storage_offset_bytes + storage_nbytes,
            )
        )
    return layers


def compute_done_event() -> tuple[torch.cuda.Event, bytes]:
    """Record an interprocess event on vLLM's current stream: the event and its
    IPC handle. Keep the event alive until the sidecar has answered."""
    event = torch.cuda.Event(interprocess=True)
    event.record()
    return event, bytes(event.ipc_handle())


def load_block_ids(chunk: ChunkTransfer) -> list[int]:
    """A chunk's block ids for LOAD_BLOCKS: ``-1`` for the blocks vLLM already holds."""
    return [-1 if i < chunk.first_block else int(b) for i, b in enumerate(chunk.block_ids)]


def load_requests(
    client: SidecarClient,
    key: Callable[[ChunkTransfer], bytes],
    reqs: Sequence[RequestTransfer],
    after_event: bytes | None = None,
) -> list[int]:
    """The sidecar scatters each request's stored prefix of full chunks into
    their blocks, all in one LOAD_BLOCKS (done when it returns); per request,
    how many chunks it loaded. Partial chunks load in host mode only.

    The scatter waits for ``after_event`` (an interprocess event's handle):
    with vLLM's asynchronous scheduling, the previous step's kernels may
    still be queued and read or write blocks that this load now fills
    (blocks freed by a finished request are handed out again at once).
    ``None`` here on CUDA records one on vLLM's current stream now."""
    fulls = [[c for c in req.chunks if not c.partial] for req in reqs]
    asked = [i for i, full in enumerate(fulls) if full]
    out = [0] * len(reqs)
    if not asked:
        return out
    event = None
    if after_event is None and torch.cuda.is_available():
        try:
            event, after_event = compute_done_event()  # kept alive until the reply
        except Exception:
            # A CUDA error (a sticky fault, no event left): without the event the
            # sidecar could fill blocks the previous step still uses, so nothing
            # loads; the caller reports every chunk and vLLM recomputes them.
            logger.exception("kvstrata: cannot order the load after vLLM's work; not loaded")
            return out
    # One LOAD_BLOCKS per tier choice (most steps: one): a chunk not in L1 is
    # promoted only from the tiers its request allows.
    by_choice: dict[frozenset[str] | None, list[int]] = {}
    for i in asked:
        by_choice.setdefault(reqs[i].load_tiers, []).append(i)
    for choice, members in by_choice.items():
        chunks = [c for i in members for c in fulls[i]]
        loaded = client.ipc.load_block_runs(
            [key(c) for c in chunks],
            [load_block_ids(c) for c in chunks],
            STEP_OWNER,
            [len(fulls[i]) for i in members],
            after_event=after_event,
            load_tiers=choice,
        )
        for i, n in zip(members, loaded or [0] * len(members), strict=True):
            out[i] = n
    del event
    return out
