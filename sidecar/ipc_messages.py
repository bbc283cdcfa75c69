"""Message bodies of the ipc-mode ops: REGISTER_KV, SAVE_BLOCKS, LOAD_BLOCKS
(see :mod:`.protocol`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kvstrata.sidecar.keys import ChunkKey
from kvstrata.sidecar.messages import Message, load_tiers_on_wire
from kvstrata.sidecar.tierchoice import TierChoice, read_tiers
from kvstrata.sidecar.wire import (
    E_BAD_REQUEST,
    LOAD_BLOCKS,
    MAX_NDIM,
    REGISTER_KV,
    SAVE_BLOCKS,
    ProtocolError,
    bad_field,
    read_int,
    read_items,
    read_keys,
    read_list,
    read_runs,
    read_shape,
    read_str,
    required,
)

IPC_HANDLE_BYTES = 64  # cudaIpcMemHandle_t / cudaIpcEventHandle_t
MAX_LAYERS = 1024
MAX_BLOCKS_PER_CHUNK = 4096
MAX_DEADLINE_MS = 3_600_000  # SAVE_BLOCKS / LOAD_BLOCKS deadline_ms: an hour at most


def _read_handle(value: Any, name: str) -> bytes:
    if not isinstance(value, bytes) or len(value) != IPC_HANDLE_BYTES:
        raise bad_field(name, f"{IPC_HANDLE_BYTES} bytes (a CUDA IPC handle)", value)
    return value


@dataclass(slots=True)
class KVLayerHandle:
    """One KV tensor shared by CUDA IPC:
    ``[handle, offset, shape, strides, mapped_nbytes]`` on the wire.

    ``mapped_nbytes`` is how many bytes of the handle's allocation the
    worker says it shares (torch: the storage's offset plus its size; 0:
    not said). The sidecar never lets a tensor reach past it, nor past
    what the device says it mapped.
    """

    handle: bytes
    offset: int  # bytes from the start of the handle's allocation to element 0
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in elements
    mapped_nbytes: int = 0

    def to_wire(self) -> list[Any]:
        return [self.handle, self.offset, list(self.shape), list(self.strides), self.mapped_nbytes]

    @classmethod
    def from_wire(cls, value: Any, name: str) -> KVLayerHandle:
        items = read_list(value, name, 5)
        if len(items) not in (4, 5):
            raise bad_field(name, "[handle, offset, shape, strides, mapped_nbytes]", value)
        shape = read_shape(items[2], f"{name}.shape")
        strides = read_shape(items[3], f"{name}.strides")
        if len(shape) != len(strides) or not shape:
            raise ProtocolError(E_BAD_REQUEST, f"field '{name}': shape and strides differ")
        return cls(
            handle=_read_handle(items[0], f"{name}.handle"),
            offset=read_int(items[1], f"{name}.offset"),
            shape=shape,
            strides=strides,
            mapped_nbytes=read_int(items[4], f"{name}.mapped_nbytes") if len(items) == 5 else 0,
        )

    def extent_nbytes(self, itemsize: int) -> int:
        """Bytes from the allocation's start to just past the tensor's last element."""
        last = sum((n - 1) * s for n, s in zip(self.shape, self.strides, strict=True))
        return self.offset + (last + 1) * itemsize


@dataclass(slots=True)
class RegisterKVRequest(Message):
    op: ClassVar[str] = REGISTER_KV
    device_uuid: str = ""  # UUID of the GPU holding the KV tensors
    kv_cache_layout: str = ""  # vLLM's KVCacheLayout name of the tensors
    block_dim: int = 0  # the tensors' block dimension
    blocks_per_chunk: int = 1  # vLLM blocks in one chunk
    dtype: str = ""  # element type of the KV
    itemsize: int = 1  # bytes per element
    # per layer: [handle, offset, shape, strides, mapped_nbytes]
    layers: list[KVLayerHandle] = field(default_factory=list)
    # vLLM's block count when its attention kernels split each of its blocks
    # into several of the tensors' (block ids name vLLM's blocks); 0: the same.
    num_blocks: int = 0
    chunk_nbytes: int = 0  # what the worker's own layout makes a chunk; 0: not checked

    def to_wire(self) -> dict[str, Any]:
        body = Message.to_wire(self)
        body["layers"] = [layer.to_wire() for layer in self.layers]
        return body

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> RegisterKVRequest:
        layers = read_items(required(body, "layers"), "layers", KVLayerHandle.from_wire, MAX_LAYERS)
        if not layers:
            raise ProtocolError(E_BAD_REQUEST, "field 'layers': no KV tensor")
        return cls(
            device_uuid=read_str(required(body, "device_uuid"), "device_uuid", 64),
            kv_cache_layout=read_str(required(body, "kv_cache_layout"), "kv_cache_layout", 16),
            block_dim=read_int(required(body, "block_dim"), "block_dim", 0, MAX_NDIM - 1),
            blocks_per_chunk=read_int(
                required(body, "blocks_per_chunk"), "blocks_per_chunk", 1, MAX_BLOCKS_PER_CHUNK
            ),
            dtype=read_str(required(body, "dtype"), "dtype", 32),
            itemsize=read_int(required(body, "itemsize"), "itemsize", 1, 16),
            layers=layers,
            num_blocks=read_int(body.get("num_blocks", 0), "num_blocks"),
            chunk_nbytes=read_int(body.get("chunk_nbytes", 0), "chunk_nbytes"),
        )


@dataclass(slots=True)
class RegisterKVReply(Message):
    op: ClassVar[str] = REGISTER_KV
    layers: int = 0  # layers registered
    chunk_nbytes: int = 0  # bytes of one chunk in the sidecar's plan

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> RegisterKVReply:
        return cls(
            layers=read_int(required(body, "layers"), "layers"),
            chunk_nbytes=read_int(required(body, "chunk_nbytes"), "chunk_nbytes"),
        )


def _read_block_ids(value: Any, name: str) -> list[int]:
    return read_items(value, name, lambda v, n: read_int(v, n, -1, (1 << 62)), MAX_BLOCKS_PER_CHUNK)


def _read_saved_block_ids(value: Any, name: str) -> list[int]:
    ids = _read_block_ids(value, name)
    if any(b < 0 for b in ids):
        # A load may skip a block vLLM already holds (-1); a save may not: the
        # slot's bytes for a skipped block would never be written, and a slot
        # never written must never be committed.
        raise ProtocolError(
            E_BAD_REQUEST, f"field {name!r}: a save names every block of a chunk (no -1)"
        )
    return ids


def _read_blocks(
    body: Mapping[str, Any], keys: list[ChunkKey], *, save: bool = False
) -> list[list[int]]:
    read = _read_saved_block_ids if save else _read_block_ids
    blocks = read_items(required(body, "block_ids"), "block_ids", read)
    if len(blocks) != len(keys):
        raise ProtocolError(
            E_BAD_REQUEST,
            f"fields 'keys' and 'block_ids' differ in length ({len(keys)}, {len(blocks)})",
        )
    return blocks


@dataclass(slots=True)
class SaveBlocksRequest(Message):
    op: ClassVar[str] = SAVE_BLOCKS
    keys: list[ChunkKey] = field(default_factory=list)  # chunks to save
    # per key, vLLM's block ids of the chunk (-1 not allowed)
    block_ids: list[list[int]] = field(default_factory=list)
    # IPC handle of a CUDA event to wait for before reading the KV (nil: none)
    after_event: bytes | None = None
    owner: str = ""  # the step or request the save belongs to
    # how long the client waits for the answer, in ms from sending (0: not said);
    # the sidecar touches no block past it (a client that gave up may reuse them)
    deadline_ms: int = 0
    tenant: str = ""  # as PREPARE_STORE's: the tenant of the chunks ("": the default)

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> SaveBlocksRequest:
        keys = read_keys(required(body, "keys"))
        event = body.get("after_event")
        return cls(
            keys=keys,
            block_ids=_read_blocks(body, keys, save=True),
            after_event=None if event is None else _read_handle(event, "after_event"),
            owner=read_str(required(body, "owner"), "owner"),
            deadline_ms=read_int(body.get("deadline_ms", 0), "deadline_ms", 0, MAX_DEADLINE_MS),
            tenant=read_str(body.get("tenant", ""), "tenant", 256),
        )


@dataclass(slots=True)
class LoadBlocksRequest(Message):
    op: ClassVar[str] = LOAD_BLOCKS
    keys: list[ChunkKey] = field(default_factory=list)  # chunks to load, in prefix order
    # per key, vLLM's block ids to fill (-1: skip that block)
    block_ids: list[list[int]] = field(default_factory=list)
    owner: str = ""  # the step or request the load belongs to
    runs: list[int] = field(default_factory=list)  # prefix lengths (one per request); empty: one
    after_event: bytes | None = None  # the copies wait for it (vLLM's queued work)
    deadline_ms: int = 0  # as SAVE_BLOCKS's: no block is touched past it
    # the tiers below L1 the chunks may be promoted from, as PREPARE_RETRIEVE's
    # (kvstrata.sidecar.tierchoice); None: every tier. L1 always serves.
    load_tiers: TierChoice = None

    def to_wire(self) -> dict[str, Any]:
        return load_tiers_on_wire(Message.to_wire(self), self.load_tiers)

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> LoadBlocksRequest:
        keys = read_keys(required(body, "keys"))
        event = body.get("after_event")
        return cls(
            keys=keys,
            block_ids=_read_blocks(body, keys),
            owner=read_str(required(body, "owner"), "owner"),
            runs=read_runs(body, keys),
            after_event=None if event is None else _read_handle(event, "after_event"),
            deadline_ms=read_int(body.get("deadline_ms", 0), "deadline_ms", 0, MAX_DEADLINE_MS),
            load_tiers=read_tiers(body.get("load_tiers"), "load_tiers"),
        )


@dataclass(slots=True)
class LoadBlocksReply(Message):
    op: ClassVar[str] = LOAD_BLOCKS
    loaded: int = 0  # chunks loaded, over every run
    loaded_runs: list[int] = field(default_factory=list)  # per run: its loaded prefix

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> LoadBlocksReply:
        return cls(
            loaded=read_int(required(body, "loaded"), "loaded"),
            loaded_runs=read_items(body.get("loaded_runs") or [], "loaded_runs", read_int),
        )
