"""What the connector's scheduler role keeps per request, and its counters.

Why a module of its own: the scheduler (:mod:`.scheduler`) and its step
tracking (:mod:`.step_tracking`) both read and write this state; keeping its
shape in one place is what lets them live apart.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvstrata.connector.request_tiers import EVERY_TIER, RequestTiers

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from kvstrata.connector.metadata import RequestTransfer
    from kvstrata.sidecar import protocol as p


@dataclass(slots=True)
class RequestState:
    request: Request
    block_ids: list[list[int]] = field(default_factory=list)  # per KV cache group
    num_computed: int = 0  # as of the last scheduled step
    local_tokens: int = 0  # vLLM's own prefix-cache hit at the last lookup
    hit_tokens: int = 0  # end of our hit (tokens) at the last lookup
    tiers: list[str] = field(default_factory=list)
    load: RequestTransfer | None = None  # to send with the next step
    load_tiers: dict[str, int] = field(default_factory=dict)  # its tokens by tier
    stored_chunks: int = 0  # chunks known stored or already sent for saving
    partial_blocks: int = 0  # blocks of the partial chunk hit at the last lookup
    partial_tier: str = ""
    partial_done: bool = False  # the prompt's partial chunk was hit or sent for saving
    pinned: bool = False  # a lookup hit: the sidecar pins a prefetch for us
    asked_blocks: int = 0  # blocks the last answered lookup asked about
    hit_chunks: int = 0  # and how many of them it found (pinned while ``pinned``)
    pending: Future[p.LookupReply | None] | None = None  # a lookup in flight
    pending_blocks: int = 0  # the blocks it asks about
    load_async: bool = False  # the hit of the last lookup loads in the background
    load_failed: bool = False  # a background load of it failed: no more hits for it
    # the tiers its kv_transfer_params let it load from and store to
    choice: RequestTiers = EVERY_TIER


@dataclass
class SchedulerCounters:
    """What the scheduler role did (read by tests, the demo and the benchmark)."""

    lookups: int = 0
    lookup_waits: int = 0  # lookups the scheduler waited for (lookup_wait_seconds)
    lookup_failures: int = 0
    hit_tokens: int = 0
    hit_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    chunks_to_load: int = 0
    chunks_to_save: int = 0
    partial_hits: int = 0  # lookups whose hit ends in a partial chunk
    partials_to_save: int = 0
    preemptions: int = 0
    errors: int = 0
    bad_params: int = 0  # requests whose kv_transfer_params could not be read
    window_skipped_saves: int = 0  # (chunk, group)s before a sliding window
