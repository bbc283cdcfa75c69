"""The scheduler role's view of each step: whose blocks are where, and what to save.

Why a module of its own: vLLM tells the scheduler role which blocks each
request holds only through each step's ``SchedulerOutput`` (new requests,
requests already running, preemptions); following that, and planning the
saves it allows, is one job, apart from lookups and loads
(:mod:`.scheduler`). :class:`StepTracker` is held by
:class:`~.scheduler.KVStrataScheduler`: it is given the settings, KV cache
groups and counters it needs, is handed the request states of each step
(the scheduler keeps them; each changes only through its own methods,
:class:`~.scheduler_state.RequestState`) and tells the scheduler through ``describe``
which chunks a save makes known (KV events).

Saves: a chunk once all its tokens are computed (chunked prefill may take
several steps), once per request, each group with its own blocks; the
prompt's partial chunk once the prefill is done (naming the partials it
supersedes, so the sidecar keeps one per prefix and chunk position).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from kvstrata.connector.metadata import ChunkTransfer, RequestTransfer
from kvstrata.connector.partial_chunks import partial_position
from kvstrata.connector.settings import NULL_BLOCK_ID

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

    from kvstrata.connector.metadata import ReqId
    from kvstrata.connector.scheduler_state import RequestState, SchedulerCounters
    from kvstrata.connector.settings import ConnectorSettings, KVGroup


class StepTracker:
    """Follows each step's blocks and plans its saves (module docstring).

    ``enabled``: the connector has a KV layout (else nothing is saved);
    ``partials``: the prompt's partial chunk is saved too (one namespace);
    ``describe(request, chunks)``: the chunks of ``request`` a save makes known."""

    def __init__(
        self,
        settings: ConnectorSettings,
        groups: tuple[KVGroup, ...],
        counters: SchedulerCounters,
        *,
        enabled: bool,
        partials: bool,
        describe: Callable[[Request, range], None],
    ) -> None:
        self.settings = settings
        self.groups = groups
        self.counters = counters
        self.enabled = enabled
        self.partials = partials
        self._describe = describe

    def track_blocks(self, so: SchedulerOutput, states: Mapping[ReqId, RequestState]) -> None:
        """Update the blocks of every request in ``states`` that step ``so`` names."""
        for req_id in so.preempted_req_ids or ():
            self.counters.preemptions += 1
            state = states.get(req_id)
            if state is not None:
                state.preempted()
        for new in so.scheduled_new_reqs:
            state = states.get(new.req_id)
            if state is not None:
                state.scheduled(list(new.block_ids or ()), new.num_computed_tokens)
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = states.get(req_id)
            if state is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.scheduled(list(new_blocks or ()), cached.num_computed_tokens[i])
            else:
                state.grew(new_blocks, cached.num_computed_tokens[i])

    def plan_save(self, state: RequestState, computed_after: int) -> RequestTransfer | None:
        """The saves ``state``'s request allows once ``computed_after`` tokens are computed."""
        s = self.settings
        if not self.enabled or len(state.block_ids) != len(self.groups) or not state.choice.stores:
            return None
        request = state.request
        done = min(computed_after, request.num_prompt_tokens)
        n_chunks = min(
            done // s.chunk_size,
            len(request.block_hashes) // s.blocks_per_chunk,
            *(len(ids) // s.blocks_per_chunk for ids in state.block_ids),
        )
        bpc = s.blocks_per_chunk
        hashes = request.block_hashes
        own = (
            partial_position(request.num_prompt_tokens, s.block_size, bpc) if self.partials else -1
        )
        chunks: list[ChunkTransfer] = []
        for c in range(state.stored_chunks, n_chunks):
            chunk_hash = bytes(hashes[(c + 1) * bpc - 1])
            # A full chunk supersedes the partials inside it, but not this
            # prompt's own (a prompt that ends in chunk c never loads c whole).
            covers = (
                []
                if not self.partials or c == own
                else [bytes(h) for h in hashes[c * bpc : (c + 1) * bpc - 1]]
            )
            for group in self.groups:
                blocks = state.block_ids[group.index][c * bpc : (c + 1) * bpc]
                # Blocks before a sliding window were freed when this step was
                # scheduled (our list may still name them): not this chunk.
                live_from = group.skipped_blocks(state.num_computed, s.block_size)
                if c * bpc < live_from or NULL_BLOCK_ID in blocks:
                    self.counters.window_skipped_saves += 1
                    continue
                chunks.append(
                    ChunkTransfer(chunk_hash, list(blocks), group=group.index, covers=covers)
                )
        if n_chunks > state.stored_chunks:
            self._describe(request, range(state.stored_chunks, n_chunks))
            state.sent_for_saving(n_chunks)
        self.counters.chunks_to_save += len(chunks)
        if self.partials and done == request.num_prompt_tokens and not state.partial_done:
            chunks += self._plan_partial_save(state, n_chunks)
        for chunk in chunks:
            chunk.store_tiers = state.choice.store
        return RequestTransfer(request.request_id, chunks) if chunks else None

    def _plan_partial_save(self, state: RequestState, n_chunks: int) -> list[ChunkTransfer]:
        """The prompt's partial chunk, once its prefill is done (see
        :func:`~kvstrata.connector.partial_chunks.partial_position`); none when a
        lookup already hit it. Like a
        hit, it stops before the block of the prompt's last token, so the same
        prompt again hits all of it (a prompt of whole chunks keeps the blocks
        of its last chunk but one as a partial chunk). One namespace only."""
        s = self.settings
        bpc = s.blocks_per_chunk
        request = state.request
        state.partial_sent()
        position = partial_position(request.num_prompt_tokens, s.block_size, bpc)
        blocks = (request.num_prompt_tokens - 1) // s.block_size
        if position < 0 or position > n_chunks:
            return []  # none, or the full chunks before it are not all there
        block_ids = state.block_ids[0]
        if min(len(request.block_hashes), len(block_ids)) < blocks:
            return []
        first, last = position * bpc, blocks
        if state.partial_blocks and last <= state.hit_tokens // s.block_size:
            return []  # this lookup hit it (or a longer one)
        hashes = request.block_hashes
        self.counters.partials_to_save += 1
        return [
            ChunkTransfer(
                chunk_hash=bytes(hashes[last - 1]),
                block_ids=block_ids[first:last],
                partial=True,
                covers=[bytes(h) for h in hashes[first : last - 1]],
            )
        ]
