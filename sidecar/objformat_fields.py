"""The object format's constants and the values its headers carry.

Why a module of its own: the writers (:mod:`.objformat_write`) and the
readers (:mod:`.objformat`) of chunk objects share the header's fixed
layout, its versions and sizes, and the typed values a header carries
(:class:`ChunkMeta`, :class:`Seal`); kept here, neither imports the other.
The format itself is described in :mod:`kvstrata.sidecar.objformat`,
which re-exports every name here.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

__all__ = [
    "FIXED_HEADER_BYTES",
    "FORMAT_VERSION",
    "MAGIC",
    "MAX_NDIM",
    "NONCE_BYTES",
    "SEALED_FORMAT_VERSION",
    "TAG_BYTES",
    "TRAILER_BYTES",
    "TRAILER_FORMAT_VERSION",
    "ChunkMeta",
    "CorruptObjectError",
    "DecodedObject",
    "Seal",
    "SealError",
    "check_meta",
    "is_sealed",
]

MAGIC = b"KVS1"
FORMAT_VERSION = 2  # payload checksum in the header
TRAILER_FORMAT_VERSION = 3  # payload checksum in a trailer after the payload
SEALED_FORMAT_VERSION = 4  # payload encrypted (AES-GCM), tag after the payload
TRAILER_BYTES = 8
TAG_BYTES = 16
NONCE_BYTES = 12
MAX_NDIM = 8
FIXED = struct.Struct("<4sHBB16sQQQQ")
FIXED_HEADER_BYTES = FIXED.size  # 56


class CorruptObjectError(ValueError):
    """The object failed validation; treat as a miss and count it."""


class SealError(CorruptObjectError):
    """A sealed object could not be opened, or a plaintext one must not be
    served; ``reason`` (``unknown_key``, ``auth_failed``, ``no_key``,
    ``plaintext``) labels ``kvstrata_decrypt_failures_total``."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Seal:
    """What a version-4 header says about its encryption."""

    key_id: str
    label: str  # the tenant whose derived key sealed it; "" for the KVCache key
    nonce: bytes

    def pack(self) -> bytes:
        key_id, label = self.key_id.encode("ascii"), self.label.encode()
        if len(key_id) > 255 or len(label) > 255 or len(self.nonce) != NONCE_BYTES:
            raise ValueError("seal: key id or tenant label longer than 255 bytes, or bad nonce")
        return bytes([len(key_id)]) + key_id + bytes([len(label)]) + label + self.nonce


@dataclass(frozen=True, slots=True)
class ChunkMeta:
    """What a chunk's bytes are: element type and shape of the KV they hold."""

    dtype: str = "uint8"
    shape: tuple[int, ...] = ()
    blocks: int = 0  # 0: a full chunk; else the blocks of a partial chunk
    # The tenant that stored it ("": the default tenant; kvstrata.sidecar.tenants).
    # Carried by a sealed object's header (its key's label); a plaintext
    # object read back from a tier below L1 is the default tenant's.
    tenant: str = ""
    # The tiers the storing request let it go to (kvstrata.sidecar.tierchoice;
    # None: every tier). Process memory only, never in a header: L2's index
    # keeps it for a chunk promoted back, the write-behind for its uploads.
    store_tiers: frozenset[str] | None = None


@dataclass(frozen=True, slots=True)
class DecodedObject:
    meta: ChunkMeta
    payload: bytes | memoryview


def is_sealed(header: bytes | memoryview) -> bool:
    """Whether a header this module wrote is a sealed (version 4) one."""
    return struct.unpack_from("<H", header, 4)[0] == SEALED_FORMAT_VERSION


def check_meta(key: bytes, meta: ChunkMeta) -> None:
    """Raise ``ValueError`` for what :func:`encode` cannot write (cheap: no payload read)."""
    if len(meta.shape) > MAX_NDIM:
        raise ValueError(f"shape has {len(meta.shape)} dims; at most {MAX_NDIM}")
    if len(key) > 255:
        raise ValueError("key longer than 255 bytes")
    if len(meta.dtype.encode("ascii")) > 16:
        raise ValueError(f"dtype name {meta.dtype!r} longer than 16 bytes")
    if not 0 <= meta.blocks <= 0xFFFF:
        raise ValueError(f"block count {meta.blocks} out of range")
