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
handle; the sidecar's stream waits for it. A load's reply comes after the
sidecar's copies have finished, so vLLM's next kernels see the blocks.
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


def kv_registration(
    tensors: Sequence[torch.Tensor],
    *,
    kv_cache_layout: str | None,
    block_dim: int,
    blocks_per_chunk: int,
) -> p.RegisterKVRequest:
    """The REGISTER_KV body for CUDA KV tensors (in model order)."""
    layers: list[p.KVLayerHandle] = []
    for t in tensors:
        storage = t.untyped_storage()
        shared = storage._share_cuda_()
        handle, storage_offset_bytes = shared[1], int(shared[3])
        if not isinstance(handle, bytes) or len(handle) != p.IPC_HANDLE_BYTES:
            # e.g. PYTORCH_CUDA_ALLOC_CONF=expandable_segments: not a cudaIpcMemHandle_t
            raise ValueError("the KV allocation has no CUDA IPC memory handle")
        layers.append(
            p.KVLayerHandle(
                handle=bytes(handle),
                offset=storage_offset_bytes + t.storage_offset() * t.element_size(),
                shape=tuple(int(d) for d in t.shape),
                strides=tuple(int(s) for s in t.stride()),
            )
        )
    first = tensors[0]
    return p.RegisterKVRequest(
        device_uuid=device_uuid(first.device),
        kv_cache_layout=kv_cache_layout or "",
        block_dim=block_dim,
        blocks_per_chunk=blocks_per_chunk,
        dtype=str(first.dtype).removeprefix("torch."),
        itemsize=first.element_size(),
        layers=layers,
    )


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
    client: SidecarClient, key: Callable[[ChunkTransfer], bytes], reqs: Sequence[RequestTransfer]
) -> list[int]:
    """The sidecar scatters each request's stored prefix of full chunks into
    their blocks, all in one LOAD_BLOCKS (done when it returns); per request,
    how many chunks it loaded. Partial chunks load in host mode only."""
    fulls = [[c for c in req.chunks if not c.partial] for req in reqs]
    asked = [i for i, full in enumerate(fulls) if full]
    out = [0] * len(reqs)
    if not asked:
        return out
    chunks = [c for i in asked for c in fulls[i]]
    loaded = client.load_block_runs(
        [key(c) for c in chunks],
        [load_block_ids(c) for c in chunks],
        STEP_OWNER,
        [len(fulls[i]) for i in asked],
    )
    for i, n in zip(asked, loaded or [0] * len(asked), strict=True):
        out[i] = n
    return out
