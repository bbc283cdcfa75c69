"""Messages the connector's scheduler role hands its worker role each step.

Why a module of its own: both roles import these, and vLLM ships them from
the scheduler to every worker inside ``SchedulerOutput`` (pickled when the
workers live in other processes), so they are plain slotted dataclasses
with no references to vLLM objects.

Chunk hashes, not keys, travel here: a chunk key is the namespace
fingerprint + the chunk hash, and the fingerprint differs per worker (it
holds the tensor-parallel rank), so each worker prefixes its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvstrata.sidecar.keys import make_key

ReqId = str


@dataclass(slots=True)
class ChunkTransfer:
    """One chunk to move between the arena and vLLM's paged KV blocks.

    ``block_ids`` are the chunk's blocks in order (``chunk_size // block_size``
    of them, fewer for a ``partial`` chunk: a prompt's full blocks after its
    last full chunk, keyed by the hash of its own last block).
    ``first_block`` is the first of them that takes part: a load skips the
    leading blocks vLLM's own prefix cache already holds (those are shared
    with other requests and must not be written) and, in a sliding-window
    group, the null blocks before the window. ``group`` is the KV cache group
    whose layers and namespace the chunk is for (0 but for hybrid models).
    ``covers`` (saves only) are the hashes of the partial chunks this one
    supersedes.
    """

    chunk_hash: bytes
    block_ids: list[int]
    first_block: int = 0
    group: int = 0
    partial: bool = False
    covers: list[bytes] = field(default_factory=list)  # saves: partials this supersedes
    # saves: the tiers its request lets it go to (kvstrata.connector.request_tiers); None: all
    store_tiers: frozenset[str] | None = None


@dataclass(slots=True)
class RequestTransfer:
    """All chunks of one request to load (or save) in one step.

    ``asynchronous`` (loads only): vLLM parks the request until the workers
    report it through ``get_finished`` (``load_kv_async``); the load runs in
    the background instead of before this step's forward pass.
    ``plan_failed``: the scheduler could not plan such a load; the workers
    report it as a failed receive (vLLM recomputes the request).
    ``tenant`` (saves only): the request's tenant, by its ``cache_salt``
    (:mod:`.tenant_match`); "" is the default tenant.
    ``load_tiers`` (loads only): the tiers the request lets its chunks come
    from (:mod:`.request_tiers`; None: every tier), so that a chunk evicted
    from L1 since the lookup is not promoted from a tier the request left out."""

    req_id: ReqId
    chunks: list[ChunkTransfer]
    asynchronous: bool = False
    plan_failed: bool = False
    tenant: str = ""
    load_tiers: frozenset[str] | None = None


@dataclass(slots=True)
class KVStrataMetadata(KVConnectorMetadata):
    """What the workers do in one step: loads before the forward pass,
    saves after it (in ``wait_for_save``). ``idle``: vLLM scheduled no token
    this step (it only keeps parked requests waiting for their loads)."""

    loads: list[RequestTransfer] = field(default_factory=list)
    saves: list[RequestTransfer] = field(default_factory=list)
    finished: list[ReqId] = field(default_factory=list)
    idle: bool = False

    def is_empty(self) -> bool:
        return not (self.loads or self.saves or self.finished)


class ChunkKeys:
    """A worker's keys of chunks: its fingerprint per KV cache group (this
    rank's namespaces) + the chunk hash (module docstring)."""

    def __init__(self, fingerprints: Sequence[bytes]) -> None:
        self.fingerprints = list(fingerprints)

    def of(self, chunk: ChunkTransfer) -> bytes:
        """The chunk's key in its KV cache group's namespace."""
        return make_key(self.fingerprints[chunk.group], chunk.chunk_hash)

    def covered(self, chunks: Sequence[ChunkTransfer]) -> list[bytes]:
        """Keys of the partial chunks ``chunks`` supersede."""
        return [make_key(self.fingerprints[c.group], h) for c in chunks for h in c.covers]
