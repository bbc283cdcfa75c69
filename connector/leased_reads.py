"""Stored chunks leased for reading, and the arena bytes under the leases.

Why a module of its own: the worker reads chunks on two paths -- inline,
before the forward pass (loads vLLM waits for), and on a thread of its own
(loads vLLM lets finish in the background, :mod:`.async_loads`) -- each over
its own sidecar session, so that a slow read never holds the other's socket.
Both lease, check and release the same way; this is that way, for one client.
Saves do not come here: they write through the same
:class:`~.arena_view.ArenaView` (:mod:`.transfer_path`).

A lease pins its slot only for the sidecar's ``lease_seconds``; a worker
thread starved of CPU, or a process stopped for a while, can reach its copy
later than that and would then copy another chunk's bytes into vLLM's KV: a
wrong token. So a load is kept only if its copies finished while its leases
surely pinned their slots (:mod:`.lease_clock`); else every chunk of it is
recomputed. Copies that run asynchronously on a device (inline CUDA loads)
are checked when they are enqueued; they then take milliseconds against a
lease of seconds.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from kvstrata.connector.arena_view import slot_fits
from kvstrata.connector.lease_clock import still_pinned

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from kvstrata.connector.arena_view import ArenaView
    from kvstrata.connector.client import SidecarClient
    from kvstrata.connector.layout import ChunkLayout
    from kvstrata.connector.metadata import ChunkKeys, ChunkTransfer, RequestTransfer

logger = logging.getLogger(__name__)

STEP_OWNER = "kvstrata-step"  # owner of a step's arena leases (released by id)

# Per request: the chunks that can be copied, each with its arena bytes.
Sources = list[tuple["ChunkTransfer", torch.Tensor]]


class LeasedReads:
    """Read leases through ``client``; leases of returned chunks are held
    (:attr:`held`) until :meth:`release_held`, after the copies from them.
    ``layouts``: one per KV cache group, to check each slot against."""

    def __init__(
        self,
        client: SidecarClient,
        keys: ChunkKeys,
        arena: ArenaView,
        layouts: tuple[ChunkLayout, ...],
    ) -> None:
        self.client = client
        self.keys = keys
        self.arena = arena
        self.layouts = layouts
        self.held: list[int] = []
        self.outlived_leases = 0  # loads dropped because their copies outlived the leases

    def lease(self, reqs: Sequence[RequestTransfer], deadline: float) -> list[Sources]:
        """Lease every request's chunks in one call; per request, the arena
        bytes of its leading chunks that fit (a partial chunk only after all
        the full ones). The leases of the returned chunks are held; the
        others are released now."""
        fulls = [[c for c in r.chunks if not c.partial] for r in reqs]
        # The session that granted the first leases: read after the first
        # call, which may itself have opened a new session (the sidecar
        # restarted since the last call: re-HELLO, then the retry answers).
        epoch: int | None = None
        out: list[Sources] = [[] for _ in reqs]
        # One call per tier choice (most steps: one call): a read promotes only
        # from the tiers its request lets it load from.
        by_choice: dict[frozenset[str] | None, list[int]] = {}
        for i, req in enumerate(reqs):
            by_choice.setdefault(req.load_tiers, []).append(i)
        for choice, members in by_choice.items():
            got = self._lease_runs([fulls[i] for i in members], 0, deadline, choice)
            if epoch is None:
                epoch = self.client.epoch
            for i, sources in zip(members, got, strict=True):
                out[i] = sources
        for i, req in enumerate(reqs):
            tail = req.chunks[len(fulls[i]) :]  # at most one partial chunk, after the full ones
            if len(out[i]) == len(fulls[i]) and len(tail) == 1:
                blocks = len(tail[0].block_ids)
                out[i] += self._lease_runs([tail], blocks, deadline, req.load_tiers)[0]
        if epoch is not None and self.client.epoch != epoch:
            # Reconnected after the first call: the leases granted before are void.
            return [[] for _ in reqs]
        return out

    def _lease_runs(
        self,
        runs: list[list[ChunkTransfer]],
        blocks: int,
        deadline: float,
        load_tiers: frozenset[str] | None = None,
    ) -> list[Sources]:
        """One PREPARE_RETRIEVE for every run's chunks, all of ``blocks`` blocks
        (0: full chunks), each run a prefix of its own, promoted only from
        ``load_tiers`` (None: every tier)."""
        out: list[Sources] = [[] for _ in runs]
        asked = [i for i, run in enumerate(runs) if run]
        keys = [self.keys.of(c) for i in asked for c in runs[i]]
        if not keys:
            return out
        slots = self.client.prepare_retrieve(
            keys,
            owner=STEP_OWNER,
            runs=[len(runs[i]) for i in asked],
            blocks=blocks,
            load_tiers=load_tiers,
        )
        if slots is None:
            return out
        epoch = self.client.epoch
        arena = self.arena.tensor()
        rest: list[int] = []
        start = 0
        for i in asked:
            run_slots = slots[start : start + len(runs[i])]
            start += len(runs[i])
            ready = out[i]
            for chunk, slot in zip(runs[i], run_slots, strict=True):
                if slot is None or arena is None or self.client.epoch != epoch:
                    break
                layout = self.layouts[chunk.group] if chunk.group < len(self.layouts) else None
                if time.monotonic() > deadline or not slot_fits(slot, layout, blocks):
                    logger.debug("kvstrata: slot %s refused (deadline or shape)", slot)
                    break
                ready.append((chunk, arena[slot.offset : slot.offset + slot.length]))
            self.held.extend(s.lease_id for s in run_slots[: len(ready)] if s)
            rest.extend(s.lease_id for s in run_slots[len(ready) :] if s is not None)
        if rest:
            self.client.release(rest)
        return out

    def load(
        self,
        reqs: Sequence[RequestTransfer],
        deadline: float,
        copy_in: Callable[[Sources], None],
    ) -> list[int]:
        """Lease ``reqs``' chunks (:meth:`lease`) and hand what fits to
        ``copy_in``; per request, how many of its leading chunks were copied
        (none of any request when the copy fails: written in part, it is
        recomputed whole, as is a load whose copies outlived its leases). The
        leases stay held for :meth:`release_held`."""
        asked_at = time.monotonic()  # no lease of this load started earlier
        try:
            ready = self.lease(reqs, deadline)
        except Exception:
            logger.exception("kvstrata: leasing the chunks to load failed; vLLM recomputes them")
            ready = []
        epoch = self.client.epoch  # lease() answers for one session only
        got = [ready[i] if i < len(ready) else [] for i in range(len(reqs))]
        work: Sources = [item for per_req in got for item in per_req]
        if work:
            try:
                copy_in(work)
            except Exception:
                logger.exception("kvstrata: copy into vLLM's KV failed; vLLM recomputes it")
                return [0] * len(reqs)
            if not still_pinned(self.client, asked_at, epoch):
                self.outlived_leases += 1
                logger.warning(
                    "kvstrata: a load's copies finished %.1f s after its leases were asked "
                    "for (leases last %.1f s); vLLM recomputes its %d chunks",
                    time.monotonic() - asked_at,
                    self.client.lease_seconds,
                    len(work),
                )
                return [0] * len(reqs)
        return [len(g) for g in got]

    def release_held(self) -> None:
        """Give back the leases of chunks whose copies have finished."""
        if self.held:
            leases, self.held = self.held, []
            self.client.release(leases)
