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
  of every chunk position, longest first, in the same round trip (with one
  namespace; with several ranks or KV cache groups hits stay whole chunks);
* with several TP/PP ranks, each rank stores under its own namespace; one
  LOOKUP names every rank's keys and the hit is the prefix all ranks hold
  (a chunk one rank lacks would otherwise be a load error);
* hybrid models (several KV cache groups): each group is stored under its
  own namespace, one object per (chunk, group), copied with that group's
  block ids; the LOOKUP names every (rank, group) namespace, so a hit is a
  prefix every group holds. A sliding-window group's blocks before its
  window are vLLM's null block: a save skips a chunk of that group unless
  all its blocks are still live, a load never writes into them;
* a waiting request vLLM asks about again every step is looked up once:
  the chunks found stay pinned for it until it finishes;
* never claims the prompt's last token: vLLM must compute at least one
  token to sample from;
* starts after ``num_computed_tokens`` (what vLLM's prefix cache already
  has) and never writes those blocks (they may be shared);
* saves follow each step's blocks (:mod:`.step_tracking`); preemption
  forgets the blocks;
* a hit that reaches below L1 loads in the background (``load_kv_async``;
  with several KV cache groups every hit does, see
  :meth:`KVStrataScheduler._loads_in_background`): vLLM parks the request
  until the workers report it, and a request whose background load failed
  is offered no hit again.

Lookups never hold vLLM's scheduler loop for long: the LOOKUP runs on one
background thread; the first time vLLM asks, the scheduler waits for the
answer (a healthy sidecar answers in well under a millisecond), at most
``lookup_wait_seconds`` in all per step however many new requests vLLM
asks about, and while it is still in flight after that the answer is
None ("ask again later", per vLLM's contract). Why wait at all:
with nothing else to run, vLLM's engine loop spins on empty steps holding
the GIL, and the lookup thread then waited for it at each of its steps
(submit, send, receive) up to a switch interval (5 ms) each: an L1 hit
measured 6-17 ms of lookup where the call itself takes 0.3 ms. Waiting on
the future hands the GIL to the lookup thread. END_REQUEST goes through
the same thread, so it always follows the request's lookup.

Any sidecar problem makes a lookup a miss; a bug here logs and counts a
miss, it never raises into vLLM's scheduler.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING

from kvstrata.connector.client import SidecarClient
from kvstrata.connector.client_arena import Populate
from kvstrata.connector.events import ChunkRegistry, KVEventFeed, describe_chunks
from kvstrata.connector.metadata import ChunkTransfer, KVStrataMetadata, ReqId, RequestTransfer
from kvstrata.connector.partial_chunks import partial_candidates
from kvstrata.connector.request_tiers import (
    NOTHING,
    KVTransferParamsError,
    RequestTiers,
    parse_request_tiers,
)
from kvstrata.connector.scheduler_state import RequestState, SchedulerCounters
from kvstrata.connector.settings import NULL_BLOCK_ID, KVGroup, LoadAsync, rank_namespaces
from kvstrata.connector.step_tracking import StepTracker
from kvstrata.connector.tenant_match import TenantMatcher
from kvstrata.sidecar import protocol as p
from kvstrata.sidecar.keys import Namespace, chunk_keys_from_block_hashes

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

    from kvstrata.connector.settings import ConnectorSettings

logger = logging.getLogger(__name__)


class KVStrataScheduler:
    def __init__(self, settings: ConnectorSettings) -> None:
        self.settings = settings
        self.enabled = settings.layout is not None
        # Every rank stores under its own namespace, and with several KV cache
        # groups every group too; a chunk is a hit only when all of them hold
        # it (rank 0's namespace first).
        self.groups = settings.groups or (KVGroup(0, (), None, settings.namespace),)
        self.rank_namespaces = rank_namespaces(settings.namespace)
        self.namespaces = [ns for g in self.groups for ns in rank_namespaces(g.namespace)]
        self.client = self._new_client(more_namespaces=self.namespaces[1:])
        # Partial chunks (block-granularity hits) with one namespace only.
        self._partials = len(self.namespaces) == 1
        # KV events (vLLM's --kv-events-config): the tiers' changes, read on a
        # session of their own (kvstrata.connector.events); rank 0's namespace
        # only, so that each chunk is one event.
        self.events: KVEventFeed | None = None
        self._described: ChunkRegistry | None = None
        if settings.kv_events and self.enabled:
            self.events = KVEventFeed(self._new_client(), settings.block_size)
            self._described = self.events.registry
        self.counters = SchedulerCounters()
        self._tenants = TenantMatcher()  # a save's tenant, by its request's cache_salt
        self._reqs: dict[ReqId, RequestState] = {}
        self._steps = StepTracker(
            settings,
            self.groups,
            self.counters,
            enabled=self.enabled,
            partials=self._partials,
            describe=self._describe,
        )
        # Background loads (load_kv_async): planned, to send with the next step;
        # sent, by request, with their blocks until the workers report them.
        self._async_planned: list[RequestTransfer] = []
        self._async_blocks: dict[ReqId, set[int]] = {}
        self._warned_chunk_size = False
        # One thread: calls run in order (a request's END_REQUEST after its LOOKUP).
        self._calls = ThreadPoolExecutor(1, thread_name_prefix="kvstrata-lookup")
        # What is left of this step's lookup_wait_s (reset by build_connector_meta).
        self._wait_left = settings.lookup_wait_s

    def _new_client(self, more_namespaces: Sequence[Namespace] = ()) -> SidecarClient:
        s = self.settings
        return SidecarClient(
            s.endpoint,
            self.namespaces[0],
            role="scheduler",
            call_timeout_s=s.call_timeout_s,
            curve=s.curve,
            more_namespaces=more_namespaces,
            kv_events=s.kv_events,
            populate_arena=Populate.OFF,  # the scheduler never copies through the arena
        )

    def take_events(self) -> list:
        """vLLM KV events of the sidecar's tiers since the last call (never waits)."""
        return self.events.take_events() if self.events is not None else []

    # -- lookups --------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int | None:
        """Prompt tokens beyond ``num_computed_tokens`` we can load (0 = none;
        None = a lookup is in flight, ask again later). Waits for a new lookup
        at most ``lookup_wait_s`` (module docstring), never for a slow sidecar beyond it."""
        try:
            return self._match(request, num_computed_tokens)
        except Exception:
            logger.exception(
                "kvstrata: lookup for %s failed; treating it as a miss", request.request_id
            )
            self.counters.errors += 1
            return 0

    def _match(self, request: Request, num_computed_tokens: int) -> int | None:
        state = self._reqs.get(request.request_id)
        if state is None:
            state = self._reqs[request.request_id] = RequestState(
                request, choice=self._choice(request)
            )
        state.asked(request, num_computed_tokens)  # blocks come with the next schedule
        if not self.enabled or state.load_failed or not state.choice.loads:
            return 0
        s = self.settings
        chunk = s.chunk_size
        bpc = s.blocks_per_chunk
        # Never the last prompt token: vLLM must compute one to sample from.
        max_blocks = min((request.num_prompt_tokens - 1) // s.block_size,
                         len(request.block_hashes))  # fmt: skip
        if not self._partials:  # whole chunks only (several ranks or KV cache groups)
            max_blocks -= max_blocks % bpc
        loadable = min(max_blocks // bpc, p.MAX_KEYS // len(self.namespaces))
        max_blocks = min(max_blocks, (loadable + 1) * bpc - 1)
        if max_blocks * s.block_size <= num_computed_tokens:
            return 0
        answer = self._lookup_answer(state, request, loadable, max_blocks)
        if answer is None:
            return None  # in flight: vLLM asks again next step
        hit_chunks, tiers, partial_blocks = answer
        hit_end = hit_chunks * chunk + partial_blocks * s.block_size
        if hit_end <= num_computed_tokens:
            state.no_hit_past_vllm()
            return 0
        state.hit(hit_end, self._loads_in_background(state, num_computed_tokens, hit_end))
        logger.debug(
            "kvstrata: %s hits %d tokens (%d local) in %s",
            request.request_id,
            hit_end,
            num_computed_tokens,
            tiers,
        )
        return hit_end - num_computed_tokens

    def _choice(self, request: Request) -> RequestTiers:
        """The tiers ``request``'s kv_transfer_params allow. Params that cannot be
        read get no load and no store: the API server's check
        (:mod:`kvstrata.connector.params_check`) refuses them before they get
        here; without it, a choice misread must not be acted on."""
        try:
            # getattr: the tests' stand-ins for vLLM's Request may leave the field out
            return parse_request_tiers(getattr(request, "kv_transfer_params", None))
        except KVTransferParamsError as exc:
            logger.warning("kvstrata: request %s: %s; no cache for it", request.request_id, exc)
            self.counters.bad_params += 1
            return NOTHING

    def _loads_in_background(self, state: RequestState, start: int, end: int) -> bool:
        """Whether the hit ``[start, end)`` loads with ``load_kv_async``: with
        several KV cache groups always (vLLM takes their failed loads per
        request only, and only from background loads); else per the
        ``load_async`` setting, ``auto`` meaning when a chunk of it is below L1
        (it must come up from disk or the shared tier first)."""
        if len(self.groups) > 1:
            return True
        mode = self.settings.load_async
        if mode is not LoadAsync.AUTO:
            return mode is LoadAsync.ALWAYS
        chunk = self.settings.chunk_size
        tiers = state.tiers[start // chunk : -(-end // chunk)]
        if state.partial_blocks and end > state.hit_chunks * chunk:
            tiers = [*tiers, state.partial_tier]
        return any(tier != "l1" for tier in tiers)

    def loads_async(self, req_id: ReqId) -> bool:
        """Whether the hit just answered for ``req_id`` loads in the background."""
        state = self._reqs.get(req_id)
        return state is not None and state.load_async

    def _lookup_answer(
        self, state: RequestState, request: Request, loadable: int, max_blocks: int
    ) -> tuple[int, list[str], int] | None:
        """(hit chunks, their tiers, partial blocks) of ``request``'s first
        ``max_blocks`` blocks: the pinned answer of an earlier lookup or that of
        a finished one (a failed lookup is a miss); None while one is in flight."""
        if state.pinned and state.asked_blocks == max_blocks:
            # Asked again (a waiting request, every step): the chunks found
            # last time stay pinned for it; no second call, no second lease.
            return state.hit_chunks, state.tiers, state.partial_blocks
        if state.pending is None or state.pending_blocks != max_blocks:
            lookup = self._start_lookup(request, loadable, max_blocks, state.choice.load)
            state.lookup_started(lookup, max_blocks)
            self._wait_for(lookup)
        if state.pending is not None and not state.pending.done():
            return None
        reply = state.take_lookup_reply()
        self._check_chunk_size()
        if reply is None:
            self.counters.lookup_failures += 1
            return 0, [], 0
        hit_chunks, tiers = min(reply.hit_chunks, loadable), list(reply.tiers)
        partial_blocks, partial_tier = 0, None
        if reply.partial >= 0 and reply.hit_chunks <= loadable:
            bpc = self.settings.blocks_per_chunk
            # candidates are longest first: index j holds (longest - j) blocks
            partial_blocks = min(bpc - 1, max_blocks - reply.hit_chunks * bpc) - reply.partial
            partial_tier = reply.partial_tier
            self.counters.partial_hits += 1
        state.answered(max_blocks, hit_chunks, tiers, partial_blocks, partial_tier)
        self._describe(request, range(hit_chunks))  # promotions into L1 become events
        return hit_chunks, tiers, partial_blocks

    def _wait_for(self, lookup: Future[p.LookupReply | None]) -> None:
        """Wait for a new lookup out of this step's ``lookup_wait_s``: one
        budget per step, not per lookup, so a burst of new requests on a
        stalled sidecar holds a step no longer than one lookup would."""
        if self._wait_left <= 0:
            return
        self.counters.lookup_waits += 1
        started = time.monotonic()
        wait((lookup,), timeout=self._wait_left)
        self._wait_left -= time.monotonic() - started

    def _start_lookup(
        self,
        request: Request,
        loadable: int,
        max_blocks: int,
        load_tiers: frozenset[str] | None = None,
    ) -> Future[p.LookupReply | None]:
        """LOOKUP (with prefetch) of the first ``loadable`` chunks of every rank
        and KV cache group, and of the partial chunks after them (one namespace
        only), on the background thread."""
        self.counters.lookups += 1
        bpc = self.settings.blocks_per_chunk
        hashes = request.block_hashes[: loadable * bpc]
        fingerprints = [self.client.fingerprint, *self.client.more_fingerprints]
        keys = [k for fp in fingerprints for k in chunk_keys_from_block_hashes(fp, hashes, bpc)]
        partials = (
            partial_candidates(
                self.client.fingerprint, request.block_hashes, bpc, loadable, max_blocks
            )
            if self._partials
            else []
        )
        return self._calls.submit(
            self.client.lookup,
            keys,
            prefetch=True,
            owner=request.request_id,
            groups=len(fingerprints),
            partials=partials,
            load_tiers=load_tiers,
        )

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
        self, request: Request, block_ids: Sequence[list[int]], num_external_tokens: int
    ) -> None:
        """Plan the load of ``num_external_tokens`` after vLLM's own hit
        (``block_ids``: the request's blocks per KV cache group)."""
        state = self._reqs.get(request.request_id)
        if state is None or num_external_tokens <= 0:
            return
        try:
            load = self._plan_load(state, block_ids, num_external_tokens)
        except Exception:
            logger.exception("kvstrata: cannot plan the load of %s", request.request_id)
            self.counters.errors += 1
            if not state.load_async:
                return
            # vLLM waits for this request's report: it must come, as a failure.
            load = RequestTransfer(request.request_id, [], asynchronous=True, plan_failed=True)
        if load.asynchronous:
            self._async_planned.append(load)
            self._async_blocks[load.req_id] = {
                b for c in load.chunks for b in c.block_ids[c.first_block :]
            }
        else:
            state.load_planned(load)

    def _plan_load(
        self, state: RequestState, block_ids: Sequence[list[int]], num_external_tokens: int
    ) -> RequestTransfer:
        s = self.settings
        bpc = s.blocks_per_chunk
        start = state.local_tokens
        end = start + num_external_tokens
        first_local_block = start // s.block_size
        chunks: list[ChunkTransfer] = []
        hashes = state.request.block_hashes
        for c in range(start // s.chunk_size, end // s.chunk_size):
            for group in self.groups:
                blocks = block_ids[group.index][c * bpc : (c + 1) * bpc]
                # vLLM's own hit and, in a sliding-window group, the null blocks
                # before the window (always leading) are never written.
                first = max(0, first_local_block - c * bpc)
                while first < len(blocks) and blocks[first] == NULL_BLOCK_ID:
                    first += 1
                if first >= len(blocks):
                    continue
                chunks.append(
                    ChunkTransfer(
                        chunk_hash=bytes(hashes[(c + 1) * bpc - 1]),
                        block_ids=list(blocks),
                        first_block=first,
                        group=group.index,
                    )
                )
        k = end // s.chunk_size
        tail = end // s.block_size - k * bpc  # full blocks of a partial chunk
        if state.partial_blocks and tail == state.partial_blocks:
            last = k * bpc + state.partial_blocks
            chunks.append(
                ChunkTransfer(
                    chunk_hash=bytes(hashes[last - 1]),
                    block_ids=list(block_ids[0][k * bpc : last]),
                    first_block=max(0, first_local_block - k * bpc),
                    partial=True,
                )
            )
        self.counters.hit_tokens += num_external_tokens
        by_tier: dict[str, int] = {}
        for c in range(start // s.chunk_size, k + (1 if tail else 0)):
            tier = state.tiers[c] if c < len(state.tiers) else state.partial_tier
            n = min((c + 1) * s.chunk_size, end) - max(start, c * s.chunk_size)
            by_tier[tier] = by_tier.get(tier, 0) + n
            self.counters.hit_tokens_by_tier[tier] = (
                self.counters.hit_tokens_by_tier.get(tier, 0) + n
            )
        state.loading(k, by_tier)
        self.counters.chunks_to_load += len(chunks)
        return RequestTransfer(
            state.request.request_id,
            chunks,
            asynchronous=state.load_async,
            load_tiers=state.choice.load,
        )

    def load_tokens_by_tier(self, req_id: ReqId) -> dict[str, int]:
        """The planned load's tokens by the tier that holds them ({} without one)."""
        state = self._reqs.get(req_id)
        return dict(state.load_tiers) if state is not None else {}

    # -- the per-step plan ------------------------------------------------------

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVStrataMetadata:
        # Background loads go out whatever else happens: vLLM waits for them.
        self._wait_left = self.settings.lookup_wait_s  # schedule() ends here: a new step next
        background, self._async_planned = self._async_planned, []
        idle = not any(scheduler_output.num_scheduled_tokens.values())
        meta = KVStrataMetadata(loads=list(background), idle=idle)
        try:
            self._steps.track_blocks(scheduler_output, self._reqs)
            for req_id, n_scheduled in scheduler_output.num_scheduled_tokens.items():
                state = self._reqs.get(req_id)
                if state is None:
                    continue
                load = state.take_load()
                if load is not None:
                    meta.loads.append(load)
                save = self._steps.plan_save(state, state.num_computed + n_scheduled)
                if save is not None:
                    save.tenant = self._tenants.tenant_of(
                        state.request.cache_salt, self.client.tenants
                    )
                    meta.saves.append(save)
        except Exception:
            logger.exception("kvstrata: cannot build this step's plan; skipping it")
            self.counters.errors += 1
            return KVStrataMetadata(loads=background, idle=idle)
        return meta

    def background_loads_finished(
        self, finished: set[ReqId], failed: set[ReqId], invalid_blocks: set[int]
    ) -> None:
        """The workers' reports (vLLM's aggregated connector output): a request
        whose background load failed in any part gets no more hits, so that a
        load that cannot succeed is not retried each time vLLM asks again."""
        for req_id in finished:
            blocks = self._async_blocks.pop(req_id, set())
            state = self._reqs.get(req_id)
            if state is not None and (req_id in failed or blocks & invalid_blocks):
                state.background_load_failed()

    # -- end of a request ---------------------------------------------------------

    def request_finished(self, req_id: ReqId) -> None:
        """Forget the request and drop its prefetch pins in the sidecar."""
        state = self._reqs.pop(req_id, None)
        if state is not None and (state.pinned or state.pending is not None):
            # On the lookup thread: after the request's LOOKUP, never before it.
            self._calls.submit(self.client.end_request, req_id)

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
        self._calls.shutdown(wait=True, cancel_futures=True)
        if self.events is not None:
            self.events.close()
        self.client.close()
