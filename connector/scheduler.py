"""The connector's scheduler role: what to load and what to save, per step.

Why separate from the worker: vLLM runs this half inside its scheduler
(one per engine), the worker half next to the KV tensors (one per rank).
This half never touches KV bytes; it asks the sidecar what is stored,
tells vLLM how many prompt tokens it can skip, and writes the per-step
plan (:class:`~kvstrata.connector.metadata.KVStrataMetadata`).

Rules it keeps:

* whole chunks count, keyed by vLLM's own ``request.block_hashes``
  (chunk ``i`` = hash of its last block), so our hits line up with vLLM's
  prefix cache and a different prefix never matches; after them, a
  *partial chunk* (a prompt's full blocks after its last full chunk, keyed
  by the hash of its own last block, :mod:`kvstrata.sidecar.partials`)
  extends a hit to the last full block: the lookup sends the candidates
  of every chunk position, longest first, in the same round trip;
* never claims the prompt's last token: vLLM must compute at least one
  token to sample from;
* starts after ``num_computed_tokens`` (what vLLM's prefix cache already
  has) and never writes those blocks (they may be shared);
* saves a chunk once all its tokens are computed (chunked prefill may
  take several steps), once per request, and the prompt's partial chunk
  once the prefill is done (naming the partials it supersedes, so the
  sidecar keeps one per prefix and chunk position); preemption forgets
  the blocks.

Any sidecar problem makes a lookup a miss; a bug here logs and counts a
miss, it never raises into vLLM's scheduler.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvstrata.connector.client import SidecarClient
from kvstrata.connector.events import ChunkRegistry, KVEventFeed, describe_chunks
from kvstrata.connector.gate import RetryGate
from kvstrata.connector.metadata import ChunkTransfer, KVStrataMetadata, ReqId, RequestTransfer
from kvstrata.sidecar.keys import chunk_keys_from_block_hashes, make_key

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

    from kvstrata.connector.settings import ConnectorSettings

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _RequestState:
    request: Request
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # as of the last scheduled step
    local_tokens: int = 0  # vLLM's own prefix-cache hit at the last lookup
    hit_tokens: int = 0  # end of our hit (tokens) at the last lookup
    tiers: list[str] = field(default_factory=list)
    load: RequestTransfer | None = None  # to send with the next step
    stored_chunks: int = 0  # chunks known stored or already sent for saving
    partial_blocks: int = 0  # blocks of the partial chunk hit at the last lookup
    partial_tier: str = ""
    partial_done: bool = False  # the prompt's partial chunk was hit or sent for saving
    pinned: bool = False  # a lookup hit: the sidecar pins a prefetch for us


@dataclass
class SchedulerCounters:
    """What the scheduler role did (read by tests, the demo and the benchmark)."""

    lookups: int = 0
    lookup_failures: int = 0
    hit_tokens: int = 0
    hit_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    chunks_to_load: int = 0
    chunks_to_save: int = 0
    partial_hits: int = 0  # lookups whose hit ends in a partial chunk
    partials_to_save: int = 0
    preemptions: int = 0
    errors: int = 0


class KVStrataScheduler:
    def __init__(self, settings: ConnectorSettings, kv_events: bool = False) -> None:
        self.settings = settings
        self.enabled = settings.layout is not None
        self.client = self._new_client()
        # KV events (vLLM's --kv-events-config): the tiers' changes, read on a
        # session of their own (kvstrata.connector.events).
        self.events: KVEventFeed | None = None
        self._described: ChunkRegistry | None = None
        if kv_events and self.enabled:
            self.events = KVEventFeed(self._new_client(), settings.block_size)
            self._described = self.events.registry
        self.gate = RetryGate(self.client, settings.retry_interval_s)
        self.counters = SchedulerCounters()
        self._reqs: dict[ReqId, _RequestState] = {}
        self._warned_chunk_size = False

    def _new_client(self) -> SidecarClient:
        s = self.settings
        return SidecarClient(
            s.endpoint,
            s.namespace,
            role="scheduler",
            call_timeout_s=s.call_timeout_s,
            curve=s.curve,
        )

    def take_events(self) -> list:
        """vLLM KV events of the sidecar's tiers since the last call (never waits)."""
        return self.events.take_events() if self.events is not None else []

    # -- lookups --------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Prompt tokens beyond ``num_computed_tokens`` we can load (0 = none)."""
        try:
            return self._match(request, num_computed_tokens)
        except Exception:
            logger.exception(
                "kvstrata: lookup for %s failed; treating it as a miss", request.request_id
            )
            self.counters.errors += 1
            return 0

    def _match(self, request: Request, num_computed_tokens: int) -> int:
        state = self._reqs.get(request.request_id)
        if state is None:
            state = self._reqs[request.request_id] = _RequestState(request)
        state.request = request
        state.block_ids = []  # new or preempted: blocks come with the next schedule
        state.load = None
        state.local_tokens = num_computed_tokens
        state.hit_tokens = state.partial_blocks = 0
        if not self.enabled:
            return 0
        chunk = self.settings.chunk_size
        bpc = self.settings.blocks_per_chunk
        # Never the last prompt token: vLLM must compute one to sample from.
        max_blocks = min((request.num_prompt_tokens - 1) // self.settings.block_size,
                         len(request.block_hashes))  # fmt: skip
        loadable = max_blocks // bpc
        if max_blocks * self.settings.block_size <= num_computed_tokens:
            return 0
        self.counters.lookups += 1
        if not self.gate.allow():  # the sidecar is down: a miss, at once
            self.counters.lookup_failures += 1
            return 0
        keys = chunk_keys_from_block_hashes(
            self.client.fingerprint, request.block_hashes[: loadable * bpc], bpc
        )
        partials = self._partial_candidates(request, loadable, max_blocks)
        reply = self.client.lookup(keys, prefetch=True, owner=request.request_id, partials=partials)
        self._check_chunk_size()
        if reply is None:
            self.counters.lookup_failures += 1
            return 0
        state.pinned = state.pinned or reply.hit_chunks > 0 or reply.partial >= 0
        hit_end = min(reply.hit_chunks, loadable) * chunk
        if reply.partial >= 0 and reply.hit_chunks <= loadable:
            # candidates are longest first: index j holds (longest - j) blocks
            longest = min(bpc - 1, max_blocks - reply.hit_chunks * bpc)
            state.partial_blocks = longest - reply.partial
            state.partial_tier = reply.partial_tier
            hit_end += state.partial_blocks * self.settings.block_size
        if hit_end <= num_computed_tokens:
            state.partial_blocks = 0
            return 0
        if state.partial_blocks:
            self.counters.partial_hits += 1
        state.hit_tokens = hit_end
        state.tiers = list(reply.tiers)
        self._describe(request, range(hit_end // chunk))  # promotions into L1 become events
        logger.debug(
            "kvstrata: %s hits %d tokens (%d local) in %s",
            request.request_id,
            hit_end,
            num_computed_tokens,
            reply.tiers,
        )
        return hit_end - num_computed_tokens

    def _partial_candidates(
        self, request: Request, loadable: int, max_blocks: int
    ) -> list[list[bytes]]:
        """Keys of the partial chunks that may follow ``i`` full chunks, for
        every ``i`` up to ``loadable``, longest first; none past ``max_blocks``."""
        bpc = self.settings.blocks_per_chunk
        fp = self.client.fingerprint
        hashes = request.block_hashes
        out: list[list[bytes]] = []
        for i in range(loadable + 1):
            longest = min(bpc - 1, max_blocks - i * bpc)
            out.append([make_key(fp, hashes[i * bpc + b - 1]) for b in range(longest, 0, -1)])
        while out and not out[-1]:
            out.pop()
        return out

    def _check_chunk_size(self) -> None:
        theirs = self.client.chunk_size
        if theirs and theirs != self.settings.chunk_size and not self._warned_chunk_size:
            self._warned_chunk_size = True
            logger.warning(
                "kvstrata: connector chunk_size %d differs from the sidecar's %d; "
                "set kv_connector_extra_config.chunk_size to match its metrics",
                self.settings.chunk_size,
                theirs,
            )

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """Plan the load of ``num_external_tokens`` after vLLM's own hit."""
        state = self._reqs.get(request.request_id)
        if state is None or num_external_tokens <= 0:
            return
        try:
            state.load = self._plan_load(state, block_ids, num_external_tokens)
        except Exception:
            logger.exception("kvstrata: cannot plan the load of %s", request.request_id)
            self.counters.errors += 1

    def _plan_load(
        self, state: _RequestState, block_ids: list[int], num_external_tokens: int
    ) -> RequestTransfer:
        s = self.settings
        bpc = s.blocks_per_chunk
        start = state.local_tokens
        end = start + num_external_tokens
        first_local_block = start // s.block_size
        chunks: list[ChunkTransfer] = []
        hashes = state.request.block_hashes
        for c in range(start // s.chunk_size, end // s.chunk_size):
            blocks = block_ids[c * bpc : (c + 1) * bpc]
            chunks.append(
                ChunkTransfer(
                    chunk_hash=bytes(hashes[(c + 1) * bpc - 1]),
                    block_ids=list(blocks),
                    first_block=max(0, first_local_block - c * bpc),
                )
            )
        k = end // s.chunk_size
        tail = end // s.block_size - k * bpc  # full blocks of a partial chunk
        if state.partial_blocks and tail == state.partial_blocks:
            last = k * bpc + state.partial_blocks
            chunks.append(
                ChunkTransfer(
                    chunk_hash=bytes(hashes[last - 1]),
                    block_ids=list(block_ids[k * bpc : last]),
                    first_block=max(0, first_local_block - k * bpc),
                    partial=True,
                )
            )
        state.stored_chunks = max(state.stored_chunks, k)
        self.counters.hit_tokens += num_external_tokens
        for c in range(start // s.chunk_size, k + (1 if tail else 0)):
            tier = state.tiers[c] if c < len(state.tiers) else state.partial_tier
            n = min((c + 1) * s.chunk_size, end) - max(start, c * s.chunk_size)
            self.counters.hit_tokens_by_tier[tier] = (
                self.counters.hit_tokens_by_tier.get(tier, 0) + n
            )
        self.counters.chunks_to_load += len(chunks)
        return RequestTransfer(state.request.request_id, chunks)

    # -- the per-step plan ------------------------------------------------------

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVStrataMetadata:
        meta = KVStrataMetadata()
        try:
            self._track_blocks(scheduler_output)
            for req_id, n_scheduled in scheduler_output.num_scheduled_tokens.items():
                state = self._reqs.get(req_id)
                if state is None:
                    continue
                if state.load is not None:
                    meta.loads.append(state.load)
                    state.load = None
                save = self._plan_save(state, state.num_computed + n_scheduled)
                if save is not None:
                    meta.saves.append(save)
        except Exception:
            logger.exception("kvstrata: cannot build this step's plan; skipping it")
            self.counters.errors += 1
            return KVStrataMetadata()
        return meta

    def _track_blocks(self, so: SchedulerOutput) -> None:
        for req_id in so.preempted_req_ids or ():
            self.counters.preemptions += 1
            state = self._reqs.get(req_id)
            if state is not None:
                state.block_ids = []
                state.load = None
        for new in so.scheduled_new_reqs:
            state = self._reqs.get(new.req_id)
            if state is not None:
                state.block_ids = list(new.block_ids[0]) if new.block_ids else []
                state.num_computed = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._reqs.get(req_id)
            if state is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = list(new_blocks[0]) if new_blocks else []
            elif new_blocks:
                state.block_ids.extend(new_blocks[0])
            state.num_computed = cached.num_computed_tokens[i]

    def _plan_save(self, state: _RequestState, computed_after: int) -> RequestTransfer | None:
        s = self.settings
        if not self.enabled:
            return None
        request = state.request
        done = min(computed_after, request.num_prompt_tokens)
        n_chunks = min(
            done // s.chunk_size,
            len(request.block_hashes) // s.blocks_per_chunk,
            len(state.block_ids) // s.blocks_per_chunk,
        )
        bpc = s.blocks_per_chunk
        hashes = request.block_hashes
        own = self._partial_position(request)
        chunks = [
            ChunkTransfer(
                chunk_hash=bytes(hashes[(c + 1) * bpc - 1]),
                block_ids=state.block_ids[c * bpc : (c + 1) * bpc],
                # supersedes the partials inside it, but not this prompt's own
                # (a prompt that ends in chunk c can never load chunk c whole)
                covers=[] if c == own else [bytes(h) for h in hashes[c * bpc : (c + 1) * bpc - 1]],
            )
            for c in range(state.stored_chunks, n_chunks)
        ]
        if chunks:
            self._describe(request, range(state.stored_chunks, n_chunks))
            state.stored_chunks = n_chunks
            self.counters.chunks_to_save += len(chunks)
        if done == request.num_prompt_tokens and not state.partial_done:
            chunks += self._plan_partial_save(state, n_chunks)
        return RequestTransfer(request.request_id, chunks) if chunks else None

    def _partial_position(self, request: Request) -> int:
        """The chunk position of the prompt's partial chunk: its full blocks
        below the block of its last token, after its last full chunk of
        those; -1 when they end on a chunk boundary."""
        blocks = (request.num_prompt_tokens - 1) // self.settings.block_size
        bpc = self.settings.blocks_per_chunk
        return blocks // bpc if blocks % bpc else -1

    def _plan_partial_save(self, state: _RequestState, n_chunks: int) -> list[ChunkTransfer]:
        """The prompt's partial chunk, once its prefill is done (see
        :meth:`_partial_position`); none when a lookup already hit it. Like a
        hit, it stops before the block of the prompt's last token, so the same
        prompt again hits all of it (a prompt of whole chunks keeps the blocks
        of its last chunk but one as a partial chunk)."""
        s = self.settings
        bpc = s.blocks_per_chunk
        request = state.request
        state.partial_done = True
        position = self._partial_position(request)
        blocks = (request.num_prompt_tokens - 1) // s.block_size
        if position < 0 or position > n_chunks:
            return []  # none, or the full chunks before it are not all there
        if min(len(request.block_hashes), len(state.block_ids)) < blocks:
            return []
        first, last = position * bpc, blocks
        if state.partial_blocks and last <= state.hit_tokens // s.block_size:
            return []  # this lookup hit it (or a longer one)
        hashes = request.block_hashes
        self.counters.partials_to_save += 1
        return [
            ChunkTransfer(
                chunk_hash=bytes(hashes[last - 1]),
                block_ids=state.block_ids[first:last],
                partial=True,
                covers=[bytes(h) for h in hashes[first : last - 1]],
            )
        ]

    # -- end of a request ---------------------------------------------------------

    def request_finished(self, req_id: ReqId) -> None:
        """Forget the request and drop its prefetch pins in the sidecar."""
        state = self._reqs.pop(req_id, None)
        if state is not None and state.pinned and self.client.available():
            self.client.end_request(req_id)

    def _describe(self, request: Request, chunks: range) -> None:
        s = self.settings
        describe_chunks(
            self._described,
            request,
            self.client.fingerprint,
            chunks,
            s.block_size,
            s.blocks_per_chunk,
        )

    def close(self) -> None:
        if self.events is not None:
            self.events.close()
        self.client.close()
