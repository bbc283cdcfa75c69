"""Which partial chunks a prompt may hit or store (block-granularity hits).

A partial chunk holds a prompt's full blocks after its last full chunk and is
keyed by the hash of its own last block (the sidecar's side:
:mod:`kvstrata.sidecar.partials`). These plain functions answer the two
questions the scheduler role asks about them; they neither call the
sidecar nor touch vLLM objects.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstrata.sidecar.keys import make_key

__all__ = ["partial_candidates", "partial_position"]


def partial_candidates(
    fingerprint: bytes,
    block_hashes: Sequence[bytes],
    blocks_per_chunk: int,
    loadable: int,
    max_blocks: int,
) -> list[list[bytes]]:
    """Keys of the partial chunks that may follow ``i`` full chunks, for every
    ``i`` up to ``loadable``, longest first; none past ``max_blocks`` blocks."""
    bpc = blocks_per_chunk
    out: list[list[bytes]] = []
    for i in range(loadable + 1):
        longest = min(bpc - 1, max_blocks - i * bpc)
        out.append(
            [make_key(fingerprint, block_hashes[i * bpc + b - 1]) for b in range(longest, 0, -1)]
        )
    while out and not out[-1]:
        out.pop()
    return out


def partial_position(num_prompt_tokens: int, block_size: int, blocks_per_chunk: int) -> int:
    """The chunk position of a prompt's partial chunk: its full blocks below
    the block of its last token, after its last full chunk of those; -1 when
    they end on a chunk boundary."""
    blocks = (num_prompt_tokens - 1) // block_size
    return blocks // blocks_per_chunk if blocks % blocks_per_chunk else -1
