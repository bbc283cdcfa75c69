"""The connector's worker role: copy chunks between the arena and vLLM's KV.

Why separate from the scheduler: this half runs next to the KV tensors
(one instance per rank) and does the byte moves the scheduler planned:

* loads, before the forward pass (``start_load_kv``): lease the chunks
  (``prepare_retrieve``), scatter each into its paged blocks layer by
  layer, release the leases once the copies have finished;
* saves, after it (``wait_for_save``): lease fresh arena space
  (``prepare_store``), gather the blocks into it, commit.

Both copy through one ``torch.frombuffer`` view over the mapped shared
arena, re-made whenever the client's :attr:`~SidecarClient.epoch` changes
(a sidecar restart re-maps the arena; slots of an older epoch are void).
Copies follow the plan of :mod:`kvstrata.connector.layout` on whatever
device vLLM's KV lives on; :mod:`kvstrata.connector.device` orders them
against vLLM's compute (inline on the CPU, own stream + events on CUDA).

A load that cannot complete (sidecar down, slot missing, wrong shape,
epoch changed, ``load_timeout_seconds`` passed) reports the blocks it did
not fill through :meth:`take_load_errors`; vLLM then recomputes them. A
save that cannot complete is dropped (a later miss). Nothing here raises
into vLLM.
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from kvstrata.connector import ipc
from kvstrata.connector.client import ArenaSlot, SidecarClient
from kvstrata.connector.device import DeviceCopies, copies_for
from kvstrata.connector.gate import RetryGate
from kvstrata.connector.layout import ChunkLayout, UnsupportedLayoutError, detect_layout
from kvstrata.connector.metadata import ChunkTransfer, KVStrataMetadata, RequestTransfer
from kvstrata.sidecar.keys import make_key

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from kvstrata.connector.settings import ConnectorSettings

logger = logging.getLogger(__name__)


@dataclass
class WorkerCounters:
    """What the worker role did (read by tests, the demo and the benchmark)."""

    loaded_chunks: int = 0
    failed_chunks: int = 0
    saved_chunks: int = 0
    save_skipped_chunks: int = 0  # already stored, or no arena space
    save_dropped_chunks: int = 0  # sidecar unavailable or copy failed
    load_seconds: float = 0.0
    save_seconds: float = 0.0


def _ranks() -> tuple[int, int]:
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        return get_tp_group().rank_in_group, get_pp_group().rank_in_group
    except Exception:  # not initialised (single process): rank 0
        return 0, 0


class KVStrataWorker:
    def __init__(self, settings: ConnectorSettings, vllm_config: VllmConfig) -> None:
        self.settings = settings
        tp_rank, pp_rank = _ranks()
        namespace = replace(settings.namespace, tp_rank=tp_rank, pp_rank=pp_rank)
        self.client = SidecarClient(
            settings.endpoint,
            namespace,
            role="worker",
            call_timeout_s=settings.call_timeout_s,
            curve=settings.curve,
        )
        self.gate = RetryGate(self.client, settings.retry_interval_s)
        self.layout: ChunkLayout | None = None
        self.counters = WorkerCounters()
        self._load_errors: set[int] = set()
        self._arena_view: torch.Tensor | None = None
        self._arena_epoch = -1
        self.copies: DeviceCopies = DeviceCopies()
        self._layer_index: dict[str, int] = {}
        self._pending_leases: list[int] = []  # held until the load copies finish

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        s = self.settings
        try:
            if s.layout is None:
                raise UnsupportedLayoutError("vLLM names no KV cache layout")
            self.layout = detect_layout(
                kv_caches,
                kv_cache_layout=s.kv_cache_layout,
                blocks_per_chunk=s.blocks_per_chunk,
                num_blocks=s.num_blocks,
            )
        except UnsupportedLayoutError as exc:
            self.layout = None
            logger.warning("kvstrata: connector disabled (every lookup misses): %s", exc)
            return
        if self.layout.device.type == "cuda" and s.transfer_mode != "host":
            self._ask_for_ipc()
        plan = self.layout.plan
        self.copies.close()
        self.copies = copies_for(self.layout.device, plan.num_layers)
        merged = plan.num_layers != len(self.layout.layer_names)  # layers coalesced into one
        self._layer_index = {
            name: 0 if merged else i for i, name in enumerate(self.layout.layer_names)
        }
        logger.info(
            "kvstrata: %d layers on %s, chunk of %d tokens = %d bytes %s",
            len(self.layout.layers),
            self.layout.device,
            s.chunk_size,
            self.layout.chunk_nbytes,
            self.layout.chunk_shape,
        )

    def _ask_for_ipc(self) -> None:
        """Offer the sidecar our KV by CUDA IPC; host mode stays if it declines."""
        layout = self.layout
        assert layout is not None  # checked by the caller
        try:
            body = ipc.kv_registration(
                layout.layers,
                kv_cache_layout=self.settings.kv_cache_layout,
                block_dim=layout.block_dim,
                blocks_per_chunk=layout.blocks_per_chunk,
            )
        except Exception:
            logger.exception("kvstrata: cannot export the KV for ipc mode; using host mode")
            return
        self.client.requested_mode = "ipc"
        self.client.register_kv(body)
        self.client.stats()  # connect now: the mode is decided at HELLO

    # -- arena --------------------------------------------------------------------

    def _arena(self) -> torch.Tensor | None:
        """The arena as one uint8 tensor, for the client's current epoch."""
        epoch = self.client.epoch
        if self._arena_view is None or epoch != self._arena_epoch:
            self.copies.unregister_arena()
            self._arena_view = None
            view = self.client.arena
            if view is None:
                return None
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self._arena_view = torch.frombuffer(view, dtype=torch.uint8)
            self._arena_epoch = epoch
            self.copies.register_arena(self._arena_view)
        return self._arena_view

    def _slot_fits(self, slot: ArenaSlot, blocks: int = 0) -> bool:
        """Whether ``slot`` holds a chunk of our layout (of ``blocks`` blocks
        for a partial chunk, 0 for a full one)."""
        layout = self.layout
        if layout is None:
            return False
        nbytes = layout.partial_nbytes(blocks) if blocks else layout.chunk_nbytes
        shape = layout.partial_shape(blocks) if blocks else layout.chunk_shape
        return (
            slot.length == nbytes
            and slot.dtype == layout.dtype_str
            and tuple(slot.shape) == shape
            and slot.offset % layout.dtype.itemsize == 0
        )

    # -- loads --------------------------------------------------------------------

    def start_load(self, meta: KVStrataMetadata | None) -> None:
        """Queue this step's loads; on CUDA they finish layer by layer on our stream."""
        self._finish_loads()
        if meta is None or not meta.loads:
            return
        started = time.perf_counter()
        if self.layout is not None and self.client.transfer_mode == "ipc":
            for req in meta.loads:
                self._load_by_sidecar(req)
            self.counters.load_seconds += time.perf_counter() - started
            return
        work: list[tuple[ChunkTransfer, torch.Tensor]] = []
        for req in meta.loads:
            try:
                ready = self._leased_sources(req) if self.layout is not None else []
            except Exception:
                logger.exception("kvstrata: load of %s failed; vLLM recomputes it", req.req_id)
                ready = []
            work.extend(ready)
            self._failed_loads(req.chunks[len(ready) :])
        if work:
            try:
                self._copy_in(work)
                self.counters.loaded_chunks += len(work)
            except Exception:
                logger.exception("kvstrata: copy into vLLM's KV failed; vLLM recomputes it")
                self._failed_loads([chunk for chunk, _ in work])
        if not self.copies.asynchronous:
            self._finish_loads()
        self.counters.load_seconds += time.perf_counter() - started

    def _load_by_sidecar(self, req: RequestTransfer) -> None:
        """ipc mode: the sidecar scatters the stored prefix; the rest is a load error."""
        fp = self.client.fingerprint
        full = [c for c in req.chunks if not c.partial]  # partial chunks: host mode only
        keys = [make_key(fp, c.chunk_hash) for c in full]
        blocks = [ipc.load_block_ids(c) for c in full]
        loaded = (self.client.load_blocks(keys, blocks, req.req_id) or 0) if full else 0
        self.counters.loaded_chunks += loaded
        self._failed_loads(req.chunks[loaded:])

    def _failed_loads(self, chunks: list[ChunkTransfer]) -> None:
        """Report chunks not loaded: vLLM recomputes their blocks."""
        for chunk in chunks:
            self._load_errors.update(chunk.block_ids[chunk.first_block :])
        self.counters.failed_chunks += len(chunks)

    def _leased_sources(self, req: RequestTransfer) -> list[tuple[ChunkTransfer, torch.Tensor]]:
        """Lease the request's chunks; the arena bytes of the leading ones that fit.

        The leases of every returned chunk stay held (``_pending_leases``)
        until the copies from them have finished; the others are released now.
        """
        layout = self.layout
        assert layout is not None  # checked by the caller
        deadline = time.monotonic() + self.settings.load_timeout_s
        full = [c for c in req.chunks if not c.partial]
        ready = self._lease_group(req.req_id, full, 0, deadline) if full else []
        tail = req.chunks[len(full) :]  # at most one partial chunk, after the full ones
        if len(ready) == len(full) and len(tail) == 1:
            ready += self._lease_group(req.req_id, tail, len(tail[0].block_ids), deadline)
        return ready

    def _lease_group(
        self, req_id: str, chunks: list[ChunkTransfer], blocks: int, deadline: float
    ) -> list[tuple[ChunkTransfer, torch.Tensor]]:
        """:meth:`_leased_sources` for chunks of one block count (0: full)."""
        fp = self.client.fingerprint
        keys = [make_key(fp, c.chunk_hash) for c in chunks]
        slots = self.client.prepare_retrieve(keys, owner=req_id, blocks=blocks)
        if slots is None:
            return []
        epoch = self.client.epoch
        arena = self._arena()
        ready: list[tuple[ChunkTransfer, torch.Tensor]] = []
        for chunk, slot in zip(chunks, slots, strict=False):
            if slot is None or arena is None or self.client.epoch != epoch:
                break
            if time.monotonic() > deadline or not self._slot_fits(slot, blocks):
                logger.debug("kvstrata: slot %s refused (deadline or shape)", slot)
                break
            ready.append((chunk, arena[slot.offset : slot.offset + slot.length]))
        held = [s.lease_id for s in slots[: len(ready)] if s is not None]
        rest = [s.lease_id for s in slots[len(ready) :] if s is not None]
        self._pending_leases.extend(held)
        if rest:
            self.client.release(rest)
        return ready

    def _copy_in(self, work: list[tuple[ChunkTransfer, torch.Tensor]]) -> None:
        """Scatter every chunk into vLLM's KV.

        Asynchronous copies (CUDA) go layer by layer, one event per layer, so
        ``wait_for_layer_load`` waits for its layer only; inline ones (CPU) go
        a chunk at a time through :meth:`ChunkLayout.scatter`, which uses the
        csrc host library for all layers at once.
        """
        layout = self.layout
        assert layout is not None  # checked by the caller
        if not self.copies.asynchronous:
            for chunk, src in work:
                layout.scatter(src, chunk.block_ids, chunk.first_block)
            return
        with self.copies.loading():
            for layer in range(layout.plan.num_layers):
                for chunk, src in work:
                    layout.copier.scatter_layer(layer, src, chunk.block_ids, chunk.first_block)
                self.copies.layer_loaded(layer)

    def wait_for_layer(self, layer_name: str) -> None:
        """Make vLLM's compute wait until ``layer_name``'s blocks are loaded."""
        index = self._layer_index.get(layer_name)
        if index is not None:
            self.copies.wait_for_layer(index)

    def _finish_loads(self) -> None:
        """Release the leases of finished loads (waits for the copies on CUDA)."""
        if self._pending_leases:
            self.copies.loads_done()
            leases, self._pending_leases = self._pending_leases, []
            self.client.release(leases)

    def take_load_errors(self) -> set[int]:
        """Blocks a load of this step failed to fill (vLLM recomputes them)."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    # -- saves --------------------------------------------------------------------

    def save(self, meta: KVStrataMetadata | None) -> None:
        self._finish_loads()
        if meta is None or not meta.saves or self.layout is None:
            return
        started = time.perf_counter()
        for req in meta.saves:
            try:
                self._save_request(req)
            except Exception:
                logger.exception("kvstrata: save of %s failed; dropped", req.req_id)
                self.counters.save_dropped_chunks += len(req.chunks)
        self.counters.save_seconds += time.perf_counter() - started

    def _save_request(self, req: RequestTransfer) -> None:
        if not self.gate.allow():  # the sidecar is down: drop the save at once
            self.counters.save_dropped_chunks += len(req.chunks)
            return
        full = [c for c in req.chunks if not c.partial]
        if full:
            self._save_chunks(req.req_id, full, 0)
        for chunk in req.chunks[len(full) :]:  # a partial chunk: host mode only
            if self.client.transfer_mode == "ipc":
                self.counters.save_skipped_chunks += 1
            else:
                self._save_chunks(req.req_id, [chunk], len(chunk.block_ids))

    def _save_chunks(self, req_id: str, chunks: list[ChunkTransfer], blocks: int) -> None:
        """Save ``chunks``, all of ``blocks`` blocks (0: full chunks)."""
        layout = self.layout
        assert layout is not None  # checked by the caller
        req = RequestTransfer(req_id, chunks)
        fp = self.client.fingerprint
        keys = [make_key(fp, c.chunk_hash) for c in req.chunks]
        covers = [make_key(fp, h) for c in req.chunks for h in c.covers]
        if self.client.transfer_mode == "ipc":
            event, handle = ipc.compute_done_event()
            committed = self.client.save_blocks(
                keys, [c.block_ids for c in req.chunks], handle, req.req_id
            )
            del event  # the sidecar has waited for it
            if committed is None:
                self.counters.save_dropped_chunks += len(req.chunks)
            else:
                self.counters.saved_chunks += sum(committed)
                self.counters.save_skipped_chunks += len(committed) - sum(committed)
            return
        nbytes = layout.partial_nbytes(blocks) if blocks else layout.chunk_nbytes
        shape = layout.partial_shape(blocks) if blocks else layout.chunk_shape
        slots = self.client.prepare_store(
            keys, nbytes, layout.dtype_str, shape, req.req_id, blocks=blocks, covers=covers
        )
        if slots is None:
            self.counters.save_dropped_chunks += len(req.chunks)
            return
        arena = self._arena()
        lease_ids: list[int] = []
        ok: list[bool] = []
        for chunk, slot in zip(req.chunks, slots, strict=False):
            if slot is None:
                self.counters.save_skipped_chunks += 1
                continue
            good = arena is not None and self._slot_fits(slot, blocks)
            if good and arena is not None:
                try:
                    with self.copies.saving():
                        layout.gather(
                            chunk.block_ids, arena[slot.offset : slot.offset + slot.length]
                        )
                except (RuntimeError, IndexError, ValueError):
                    logger.exception("kvstrata: copy into slot %d failed", slot.lease_id)
                    good = False
            lease_ids.append(slot.lease_id)
            ok.append(good)
        if not lease_ids:
            return
        if self.client.commit_store(lease_ids, ok):
            self.counters.saved_chunks += sum(ok)
        else:
            self.counters.save_dropped_chunks += len(lease_ids)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._finish_loads()
        self.copies.close()
        self._arena_view = None
        self.client.close()
