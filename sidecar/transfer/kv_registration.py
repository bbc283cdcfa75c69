"""REGISTER_KV's checks and plan: open a worker's KV handles, bound each tensor, plan the copies.

Why a module of its own: everything a registration trusts is decided here,
before :class:`~kvstrata.sidecar.transfer.ipc.IpcTransfers` installs it
for the session: each tensor must lie inside the allocation it is mapped
from (the kernels trust the plan, and a block past the mapping is an
illegal address for the sidecar's whole CUDA context, or another tenant's
bytes), the worker's idea of a chunk's size must match the tensors', and a
chunk must fit the arena. A refusal closes whatever it opened first and
raises :class:`~kvstrata.sidecar.wire.ProtocolError` naming the field.
"""

from __future__ import annotations

from kvstrata.sidecar import protocol as p
from kvstrata.sidecar.transfer.ipc_device import TransferDevice
from kvstrata.sidecar.transfer.plan import (
    CopyPlan,
    TensorGeometry,
    UnsupportedLayoutError,
    per_manager_block,
    plan_from_geometry,
)

__all__ = ["check_extent", "open_and_plan"]


def check_extent(
    index: int, layer: p.KVLayerHandle, itemsize: int, device_nbytes: int | None
) -> None:
    """Refuse a tensor that reaches past the allocation it is mapped from: the
    kernels trust the plan, and a block past the mapping is an illegal address
    (a fault for the sidecar's whole CUDA context) or another tenant's bytes."""
    bounds = [n for n in (device_nbytes, layer.mapped_nbytes or None) if n is not None]
    if not bounds:
        raise UnsupportedLayoutError(
            f"field 'layers[{index}].mapped_nbytes': not given, and the device cannot tell "
            "the allocation's size"
        )
    limit = min(bounds)
    extent = layer.extent_nbytes(itemsize)
    if extent > limit:
        raise UnsupportedLayoutError(
            f"layer {index}: shape {layer.shape} strides {layer.strides} at offset "
            f"{layer.offset} reach byte {extent}, past the {limit} bytes mapped"
        )


def open_and_plan(
    device: TransferDevice, body: p.RegisterKVRequest, arena_size: int
) -> tuple[list[int], CopyPlan, int]:
    """Open the layers' handles and plan the copies: ``(the opened addresses,
    the plan, a chunk's bytes)``. A refusal closes what it opened first."""
    opened: dict[bytes, int] = {}
    try:
        geometries = []
        for i, layer in enumerate(body.layers):
            if any(n < 1 for n in layer.shape):
                raise UnsupportedLayoutError(f"layer {i}: empty shape {layer.shape}")
            if layer.handle not in opened:
                opened[layer.handle] = device.open_memory(layer.handle)
            check_extent(i, layer, body.itemsize, device.mapped_nbytes(opened[layer.handle]))
            geometries.append(
                TensorGeometry(
                    address=opened[layer.handle] + layer.offset,
                    shape=layer.shape,
                    strides=layer.strides,
                    itemsize=body.itemsize,
                )
            )
        plan = plan_from_geometry(geometries, body.block_dim)
        if body.num_blocks:
            plan = per_manager_block(plan, body.num_blocks)
        plan = plan.coalesced()
        chunk_nbytes = plan.chunk_nbytes(body.blocks_per_chunk)
        if body.chunk_nbytes and chunk_nbytes != body.chunk_nbytes:
            raise UnsupportedLayoutError(
                f"field 'chunk_nbytes': the worker makes a chunk {body.chunk_nbytes} bytes, "
                f"these tensors make it {chunk_nbytes}"
            )
    except (UnsupportedLayoutError, OSError) as exc:
        for address in opened.values():
            device.close_memory(address)
        raise p.ProtocolError(p.E_UNSUPPORTED, f"REGISTER_KV: {exc}") from None
    if chunk_nbytes > arena_size:
        for address in opened.values():
            device.close_memory(address)
        raise p.ProtocolError(
            p.E_BAD_REQUEST,
            f"REGISTER_KV: a chunk of {chunk_nbytes} bytes exceeds the arena ({arena_size})",
        )
    return list(opened.values()), plan, chunk_nbytes
