"""What the connector's scheduler role keeps per request, and its counters.

Why a module of its own: the scheduler (:mod:`.scheduler`) and its step
tracking (:mod:`.step_tracking`) both read this state; keeping its shape
in one place is what lets them live apart. :class:`RequestState` is the
one owner of its fields: they read them, and change them only through its
named methods, each one event of the request's life (a lookup asked and
answered, a load planned and sent, blocks scheduled, a save sent), so
that what one event changes is said in one place
(``tests/unit/connector/test_request_state_owner.py`` keeps it so).
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
    """One request as the scheduler role follows it (module docstring)."""

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

    # -- lookups (the scheduler) ---------------------------------------------------

    def asked(self, request: Request, num_computed_tokens: int) -> None:
        """vLLM asks how much of ``request`` we hold (new, waiting or preempted):
        no blocks and no load until it is scheduled again, no hit yet."""
        self.request = request
        self.block_ids = []
        self.load = None
        self.local_tokens = num_computed_tokens
        self.hit_tokens = 0
        self.load_async = False

    def lookup_started(self, lookup: Future[p.LookupReply | None], blocks: int) -> None:
        """A LOOKUP of the first ``blocks`` blocks went out."""
        self.pending, self.pending_blocks = lookup, blocks

    def take_lookup_reply(self) -> p.LookupReply | None:
        """The reply of the pending lookup, which has finished (None: it
        failed); none is pending after."""
        reply = self.pending.result() if self.pending is not None else None
        self.pending = None
        return reply

    def answered(
        self,
        blocks: int,
        hit_chunks: int,
        tiers: list[str],
        partial_blocks: int,
        partial_tier: str | None,
    ) -> None:
        """A lookup of ``blocks`` blocks found ``hit_chunks`` chunks (in
        ``tiers``) and a partial chunk of ``partial_blocks`` blocks after them
        (0: none) in ``partial_tier`` (None: the answer named none, the
        earlier one stays); what it found stays pinned."""
        self.pinned = self.pinned or hit_chunks > 0 or partial_blocks > 0
        self.asked_blocks, self.hit_chunks, self.tiers = blocks, hit_chunks, tiers
        self.partial_blocks = partial_blocks
        if partial_tier is not None:
            self.partial_tier = partial_tier

    def no_hit_past_vllm(self) -> None:
        """What the lookup found ends within vLLM's own hit: no partial chunk to load."""
        self.partial_blocks = 0

    def hit(self, end: int, load_async: bool) -> None:
        """The hit ends at token ``end``, loading in the background or not."""
        self.hit_tokens, self.load_async = end, load_async

    # -- loads (the scheduler) -----------------------------------------------------

    def load_planned(self, load: RequestTransfer) -> None:
        """An inline load to send with the next step."""
        self.load = load

    def loading(self, chunks_known: int, tokens_by_tier: dict[str, int]) -> None:
        """The planned load brings its first ``chunks_known`` chunks (never saved
        again), ``tokens_by_tier`` from each tier."""
        self.stored_chunks = max(self.stored_chunks, chunks_known)
        self.load_tiers = tokens_by_tier

    def take_load(self) -> RequestTransfer | None:
        """The inline load to send with this step, once."""
        load, self.load = self.load, None
        return load

    def background_load_failed(self) -> None:
        """A background load of it failed: it is offered no hit again."""
        self.load_failed = True

    # -- blocks and saves (the step tracking) ----------------------------------------

    def preempted(self) -> None:
        """vLLM took its blocks back: none held, nothing to load into them."""
        self.block_ids = []
        self.load = None

    def scheduled(self, block_ids: list[list[int]], num_computed: int) -> None:
        """Scheduled with these blocks per KV cache group (new or resumed)."""
        self.block_ids = [list(ids) for ids in block_ids]
        self.num_computed = num_computed

    def grew(self, new_block_ids: list[list[int]] | None, num_computed: int) -> None:
        """Scheduled again, with ``new_block_ids`` per group after those held."""
        if new_block_ids:
            if not self.block_ids:
                self.block_ids = [[] for _ in new_block_ids]
            for mine, ids in zip(self.block_ids, new_block_ids, strict=True):
                mine.extend(ids)
        self.num_computed = num_computed

    def sent_for_saving(self, chunks: int) -> None:
        """Its first ``chunks`` chunks are saved or on their way."""
        self.stored_chunks = chunks

    def partial_sent(self) -> None:
        """The prompt's partial chunk was saved or judged not worth saving: once only."""
        self.partial_done = True


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
