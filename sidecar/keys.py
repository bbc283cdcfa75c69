"""Namespaces, chunk keys and the vLLM prefix-cache hash chain.

A chunk is ``chunk_size`` tokens (a multiple of vLLM's block size). Its key
is::

    ChunkKey = namespace fingerprint (16 bytes) + chunk hash (32 bytes)

where the chunk hash is vLLM's block hash of the chunk's *last* block. vLLM
chains its block hashes over the whole prefix, so the hash of a chunk's last
block fingerprints every token before it as well: keys from our connector
(which reads ``request.block_hashes``) match vLLM's own prefix cache, and a
client that only has token ids reproduces them with :class:`BlockHasher`.

vLLM's chain (``vllm.v1.core.kv_cache_utils.hash_block_tokens`` with the
default ``sha256_cbor``, checked against vLLM 0.32 by
``tests/unit/sidecar/test_keys.py``)::

    NONE_HASH  = sha256(cbor(seed))          seed = $PYTHONHASHSEED or "vllm-none-hash"
    hash(b_i)  = sha256(cbor((hash(b_{i-1}) or NONE_HASH, tuple(tokens_i), extra_keys)))

with canonical CBOR. ``extra_keys`` is None, or a tuple of
``("lora", name, path)``, ``("cache_salt", salt)`` (first block only) and
multimodal entries.

The namespace fingerprint separates everything that makes the same token
chain produce different KV bytes: model and revision, KV dtype and layout,
block and chunk size, tensor/pipeline rank and size, and the tenant's
``cache_salt`` / LoRA adapter. Two models or two tenants never share an entry.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, NewType

import cbor2

BlockHash = NewType("BlockHash", bytes)
ChunkKey = NewType("ChunkKey", bytes)

FINGERPRINT_BYTES = 16
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"


def sha256_cbor(value: Any) -> bytes:
    """SHA-256 over canonical CBOR: vLLM's default prefix-cache hash."""
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


def none_hash(seed: str | None = None) -> BlockHash:
    """The parent hash of a prompt's first block.

    ``seed`` defaults like vLLM's: ``$PYTHONHASHSEED`` if set, else a fixed
    string, so it is the same in every process (the operator also sets
    ``PYTHONHASHSEED`` in injected pods so sidecar and vLLM agree).
    """
    if seed is None:
        seed = os.environ.get("PYTHONHASHSEED", DEFAULT_NONE_HASH_SEED)
    return BlockHash(sha256_cbor(seed))


@dataclass(frozen=True, slots=True)
class Namespace:
    """Everything that must match for two chunks with equal hashes to be
    interchangeable. Unknown or irrelevant fields stay at their defaults."""

    model: str
    revision: str = ""
    kv_dtype: str = "auto"
    layout: str = ""
    block_size: int = 16
    chunk_size: int = 256
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    cache_salt: str = ""
    lora: str = ""

    def fingerprint(self) -> bytes:
        """16 bytes that differ whenever any field differs."""
        return sha256_cbor(("kvstrata-ns-v1", sorted(asdict(self).items())))[:FINGERPRINT_BYTES]


def make_key(fingerprint: bytes, chunk_hash: bytes) -> ChunkKey:
    if len(fingerprint) != FINGERPRINT_BYTES:
        raise ValueError(f"namespace fingerprint must be {FINGERPRINT_BYTES} bytes")
    return ChunkKey(fingerprint + chunk_hash)


def chunk_keys_from_block_hashes(
    fingerprint: bytes, block_hashes: Sequence[bytes], blocks_per_chunk: int
) -> list[ChunkKey]:
    """Keys of every *full* chunk covered by ``block_hashes``.

    Chunk ``i`` is keyed by the hash of its last block,
    ``block_hashes[(i + 1) * blocks_per_chunk - 1]``.
    """
    if blocks_per_chunk < 1:
        raise ValueError("blocks_per_chunk must be >= 1")
    n_chunks = len(block_hashes) // blocks_per_chunk
    return [
        make_key(fingerprint, block_hashes[(i + 1) * blocks_per_chunk - 1]) for i in range(n_chunks)
    ]


def key_hex(key: bytes) -> str:
    """Stable printable form (file names, Valkey keys, S3 object names)."""
    return key.hex()


class BlockHasher:
    """Reproduces vLLM's block-hash chain from token ids.

    For clients that send token ids instead of vLLM's ``block_hashes``.
    ``extra_keys_first`` is applied to the first block only (cache_salt);
    ``extra_keys_all`` to every block (LoRA).
    """

    def __init__(self, block_size: int, seed: str | None = None) -> None:
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.block_size = block_size
        self.none_hash = none_hash(seed)

    def hash_blocks(
        self,
        token_ids: Sequence[int],
        cache_salt: str | None = None,
        lora: tuple[str, str] | None = None,
        parent: bytes | None = None,
    ) -> list[BlockHash]:
        """Hashes of every full block of ``token_ids`` (a partial tail is skipped)."""
        out: list[BlockHash] = []
        prev = parent or self.none_hash
        bs = self.block_size
        for start in range(0, len(token_ids) - bs + 1, bs):
            extra: list[tuple[Any, ...]] = []
            if lora is not None:
                extra.append(("lora", lora[0], lora[1]))
            if cache_salt and start == 0 and parent is None:
                extra.append(("cache_salt", cache_salt))
            block = tuple(int(t) for t in token_ids[start : start + bs])
            prev = BlockHash(sha256_cbor((prev, block, tuple(extra) if extra else None)))
            out.append(prev)
        return out


def iter_prefix(keys: Iterable[ChunkKey], present: Iterable[bool]) -> int:
    """Length of the leading run of ``True`` in ``present`` (the usable prefix)."""
    n = 0
    for _, ok in zip(keys, present, strict=False):
        if not ok:
            break
        n += 1
    return n
