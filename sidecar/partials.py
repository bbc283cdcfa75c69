"""Partial chunks: a prompt's full blocks after its last full chunk.

Why: hits should reach the last full *block* of a prompt (as vLLM's own
prefix cache does), while the chunk stays the unit of storage and
eviction. So a prompt's tail is stored as a *partial chunk*: the ``b``
full blocks (``1 <= b < blocks_per_chunk``) after its ``k`` full chunks,
keyed like any chunk by the vLLM block hash of its own last block::

    partial key = namespace fingerprint + hash(block k * blocks_per_chunk + b - 1)

A full chunk is keyed by the hash of block ``(k + 1) * blocks_per_chunk - 1``,
so the two never share a key. The block count ``b`` is in the object's
header (:class:`~kvstrata.sidecar.objformat.ChunkMeta` ``blocks``, 0 for a
full chunk); a reader names the count it expects, and an object with any
other count is a miss.

Lookup: the client sends, after the full chunk keys, the candidate partial
keys for each chunk position, longest first (``LookupRequest.partials``);
the sidecar answers the first candidate some tier holds at the position
where the full prefix ends (one round trip).

Bounded storage: a store names the partial keys it supersedes
(``PrepareStoreRequest.covers``): the shorter partials of the same prefix
for a partial, every partial inside it for a full chunk. Those found as
partials in L1 or L2 are removed from every tier and counted
(``partial_replaced_total`` / ``partial_dropped_total``), so one prefix
keeps at most one partial per chunk position. In the shared tier, where other
sidecars' partials live too, the store's deepest chunk carries the covered
keys (``Entry.supersedes``) and write-behind deletes them there once that
chunk is written (``partial_superseded_deleted_total``: keys sent for
deletion, absent ones included).
"""

from __future__ import annotations

from kvstrata.sidecar.l1 import Entry
from kvstrata.sidecar.objformat import ChunkMeta

__all__ = ["blocks_match", "is_partial"]


def is_partial(meta: ChunkMeta | None) -> bool:
    return meta is not None and meta.blocks > 0


def entry_is_partial(entry: Entry | None) -> bool:
    return entry is not None and is_partial(entry.meta)


def blocks_match(meta: ChunkMeta, expected: int) -> bool:
    """Whether an object holds the block count a reader expects (0: a full chunk)."""
    return meta.blocks == expected
