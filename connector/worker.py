"""The connector's worker role: copy chunks between the arena and vLLM's KV.

Why separate from the scheduler: this half runs next to the KV tensors
(one instance per rank) and does the byte moves the scheduler planned:

* loads, before the forward pass (``start_load_kv``): lease the chunks
  (``prepare_retrieve``), scatter each into its paged blocks layer by
  layer, release the leases once the copies have finished; loads the
  scheduler marked asynchronous (hits below L1) go to a thread and session
  of their own instead (:mod:`~kvstrata.connector.async_loads`), reported
  through ``get_finished``;
* saves, after it (``wait_for_save``): lease fresh arena space
  (``prepare_store``), gather the blocks into it, commit.

One round trip per step and direction: every request's chunks of a step go
in one PREPARE_RETRIEVE (one run per request, so a miss ends only its own
request's prefix) and one RELEASE (one LOAD_BLOCKS with the same runs in ipc
mode), or one PREPARE_STORE and one COMMIT_STORE (one SAVE_BLOCKS in ipc
mode; more pairs only when the step's chunks exceed what the sidecar lets
one session hold uncommitted), under the step owner :data:`STEP_OWNER`
(leases are ended by id, never by owner).

How chunks move on a session -- copied here through the arena (host mode)
or by the sidecar, told block ids (ipc mode) -- is one
:class:`~kvstrata.connector.transfer_path.TransferPath`, chosen when vLLM
registers its KV caches.

Hybrid models (several KV cache groups): one :class:`ChunkLayout` per
group over that group's layers; a chunk names its group, whose layout and
namespace (key fingerprint) it is copied and stored with. ipc mode is for
a single group; hybrid models copy in host mode.

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
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from kvstrata.connector import ipc
from kvstrata.connector.async_loads import AsyncLoads, FinishedLoads, LoadReports, outcome_of
from kvstrata.connector.client import SidecarClient
from kvstrata.connector.client_arena import Populate
from kvstrata.connector.client_ipc import REGISTER_TIMEOUT_S
from kvstrata.connector.cpu_amx import ask_for_amx_tiles
from kvstrata.connector.device import DeviceCopies, copies_for
from kvstrata.connector.layout import (
    ChunkLayout,
    UnsupportedLayoutError,
    detect_layout,
    scatter_on_host,
)
from kvstrata.connector.leased_reads import Sources
from kvstrata.connector.metadata import ChunkKeys, ChunkTransfer, KVStrataMetadata, RequestTransfer
from kvstrata.connector.transfer_path import HostPath, IpcPath, TransferPath

if TYPE_CHECKING:
    from collections.abc import Sequence

    from vllm.config import VllmConfig

    from kvstrata.connector.settings import ConnectorSettings, KVGroup
    from kvstrata.sidecar import protocol as p

logger = logging.getLogger(__name__)

# How long an empty step waits for a background load to report (take_finished):
# a load that lands meanwhile ends the wait at once, a new request waits no longer.
IDLE_STEP_WAIT_S = 0.001


@dataclass
class WorkerCounters:
    """What the worker role did (read by tests, the demo and the benchmark)."""

    loaded_chunks: int = 0
    failed_chunks: int = 0
    async_loads: int = 0  # requests whose load vLLM let finish in the background
    saved_chunks: int = 0
    save_skipped_chunks: int = 0  # already stored, or no arena space
    save_dropped_chunks: int = 0  # sidecar unavailable or copy failed
    load_seconds: float = 0.0
    save_seconds: float = 0.0
    idle_waits: int = 0  # empty steps that waited for a background load (take_finished)


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
        namespaces = [
            replace(g.namespace, tp_rank=tp_rank, pp_rank=pp_rank) for g in settings.groups
        ] or [replace(settings.namespace, tp_rank=tp_rank, pp_rank=pp_rank)]
        self._namespaces = namespaces
        self.client = self._new_client(settings.call_timeout_s)
        # Key fingerprint per KV cache group (this rank's).
        self._keys = ChunkKeys([self.client.fingerprint, *self.client.more_fingerprints])
        self.layout: ChunkLayout | None = None  # group 0's (the only one but for hybrids)
        self.layouts: tuple[ChunkLayout, ...] = ()  # one per KV cache group
        self.counters = WorkerCounters()
        self._load_errors: set[int] = set()
        # How chunks move on our main session (host or ipc), chosen when the KV
        # caches are registered; loads vLLM waits for hold their leases until
        # the copies end.
        self.transfer: TransferPath = HostPath(self.client, self._keys, (), DeviceCopies())
        # Loads vLLM lets finish in the background (load_kv_async), on a session
        # and thread of their own, set up when the KV is registered; reported
        # via get_finished.
        self.reports = LoadReports(whole_requests=len(settings.groups) > 1)
        self._background: AsyncLoads | None = None
        # The IPC references our KV exports took (ipc mode), given back at close.
        self._ipc_references = ipc.IpcReferences()

    def _new_client(
        self, call_timeout_s: float, populate: Populate = Populate.BACKGROUND
    ) -> SidecarClient:
        s = self.settings
        return SidecarClient(
            s.endpoint,
            self._namespaces[0],
            role="worker",
            call_timeout_s=call_timeout_s,
            curve=s.curve,
            more_namespaces=self._namespaces[1:],
            kv_events=s.kv_events,
            populate_arena=populate,
        )

    def _populate_mode(self) -> Populate:
        """On CPU, the arena's page table is filled at registration, before vLLM
        serves: filled in the background, the thread ran on the core vLLM
        computes on during its first requests (a fresh server's first prompts
        took up to 2x as long in ``kvstrata bench serve``). On CUDA, registering
        the mapping as pinned memory maps its pages anyway."""
        on_cpu = self.layout is not None and self.layout.device.type == "cpu"
        return Populate.NOW if on_cpu else Populate.BACKGROUND

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        s = self.settings
        try:
            if s.layout is None:
                raise UnsupportedLayoutError("vLLM names no KV cache layout")
            self.layouts = tuple(
                detect_layout(
                    caches,
                    kv_cache_layout=s.kv_cache_layout,
                    blocks_per_chunk=s.blocks_per_chunk,
                    num_blocks=s.num_blocks,
                )
                for caches in _caches_by_group(kv_caches, s.groups)
            )
        except UnsupportedLayoutError as exc:
            self.layout, self.layouts = None, ()
            logger.warning("kvstrata: connector disabled (every lookup misses): %s", exc)
            return
        self.layout = self.layouts[0]
        if self.layout.device.type == "cpu":
            ask_for_amx_tiles()  # before vLLM's first step: see connector/cpu_amx.py
        hybrid = len(self.layouts) > 1
        registration = None
        if self.layout.device.type == "cuda" and s.transfer_mode.may_use_ipc and not hybrid:
            registration = self._ask_for_ipc()
        self.transfer.close()
        host = HostPath(self.client, self._keys, self.layouts, copies_for(self.layout.device))
        self.transfer = host if registration is None else IpcPath(host, registration)
        if self._populate_mode() is Populate.NOW and not self.client.available():
            # Connect the step session now, its arena mapped and populated
            # (a sidecar not up yet: the first call connects, in the background).
            self.client.connect(populate=Populate.NOW)
        self._start_loader()
        logger.info(
            "kvstrata: %d layers on %s, chunk of %d tokens = %d bytes %s",
            len(self.layout.layers),
            self.layout.device,
            s.chunk_size,
            self.layout.chunk_nbytes,
            self.layout.chunk_shape,
        )

    @property
    def copies(self) -> DeviceCopies:
        """Where this worker's copies run (see :mod:`.device`)."""
        return self.transfer.copies

    def _ask_for_ipc(self) -> p.RegisterKVRequest | None:
        """Offer the sidecar our KV by CUDA IPC; the registration, or None when
        it cannot be made (host mode stays also when the sidecar declines)."""
        layout = self.layout
        assert layout is not None  # checked by the caller
        try:
            body = ipc.kv_registration(
                layout.layers,
                references=self._ipc_references,
                kv_cache_layout=self.settings.kv_cache_layout,
                block_dim=layout.block_dim,
                blocks_per_chunk=layout.blocks_per_chunk,
                num_blocks=layout.plan.num_blocks,
                chunk_nbytes=layout.chunk_nbytes,
            )
        except ipc.IpcExportError as exc:
            self.client.ipc_unavailable(f"cannot export the KV: {exc}")
            return None
        except Exception as exc:
            logger.exception("kvstrata: cannot export the KV for ipc mode")
            self.client.ipc_unavailable(f"cannot export the KV: {exc}")
            return None
        self.client.register_kv(body)  # and asks for ipc mode at HELLO
        # Connect now (the mode is decided at HELLO) with the patience of a first
        # registration, for this call only: the sidecar page-locks its arena for
        # our GPU then.
        self.client.connect(timeout_s=max(self.settings.call_timeout_s, REGISTER_TIMEOUT_S))
        return body

    # -- loads --------------------------------------------------------------------

    def start_load(self, meta: KVStrataMetadata | None) -> None:
        """Queue this step's loads: inline ones finish before anything vLLM
        queues after this call (on CUDA, vLLM's stream waits for our copy
        stream: :mod:`.device`), background ones on their own thread
        (:mod:`~kvstrata.connector.async_loads`). Never raises: a load that
        fails is reported and vLLM recomputes its blocks."""
        self._finish_loads()
        if meta is None or not meta.loads:
            return
        started = time.perf_counter()
        background = [req for req in meta.loads if req.asynchronous]
        inline = [req for req in meta.loads if not req.asynchronous]
        if background:
            self._start_background(background)
        if inline:
            try:
                loaded_per_req = self._load_inline(inline)
            except Exception:  # a CUDA error, a bug: a recompute, never vLLM's step
                logger.exception("kvstrata: this step's loads failed; vLLM recomputes them")
                loaded_per_req = [0] * len(inline)
            for req, loaded in zip(inline, loaded_per_req, strict=True):
                self.counters.loaded_chunks += loaded
                self._failed_loads(req.chunks[loaded:])
        self.counters.load_seconds += time.perf_counter() - started

    def _start_loader(self) -> None:
        """The background loader for the layouts just registered, its session
        set up at once on its own thread (HELLO, arena mapping, the arena's
        registration with the device): made at the first async load instead,
        that set-up sat in front of the first request a new replica parks."""
        if self._background is not None:
            self._background.close()
            self._background = None
        if self.layout is None:
            return
        client = self._new_client(self.settings.load_timeout_s, self._populate_mode())
        # The device's copies register its arena mapping (pinned for CUDA);
        # their stream is the one its copies run on.
        path = self.transfer.for_session(client, copies_for(self.layout.device))
        self._background = AsyncLoads(path, self.settings.load_timeout_s, self.reports)

    def _start_background(self, reqs: list[RequestTransfer]) -> None:
        self.counters.async_loads += len(reqs)
        if self._background is not None:
            self._background.submit(reqs)
        else:  # no usable layout: nothing loads; reported with this step's get_finished
            self.reports.report([outcome_of(r, 0) for r in reqs])

    def _load_inline(self, reqs: list[RequestTransfer]) -> list[int]:
        """Load ``reqs`` before this step's forward pass; per request, how many
        of its leading chunks were (or, on CUDA, are being) copied."""
        if self.layout is None:
            return [0] * len(reqs)
        deadline = time.monotonic() + self.settings.load_timeout_s
        loaded = self.transfer.load(reqs, deadline, self._copy_in)
        if not self.copies.asynchronous:
            self._finish_loads()
        return loaded

    def take_finished(self, idle: bool = False) -> FinishedLoads:
        """Background loads finished since the last call; the blocks they
        failed to fill go out with this pass's load errors.

        ``idle``: vLLM scheduled nothing this step. With a background load in
        flight and none reported yet, wait for one up to
        :data:`IDLE_STEP_WAIT_S`: vLLM would otherwise run its next empty step
        at once, spinning on a core and holding the GIL, which the loader
        thread needs after each of its calls (up to a switch interval, 5 ms,
        each time), while the sidecar and the shared tier feeding the load
        lack that core."""
        if (
            idle
            and self._background is not None
            and self._background.in_flight()
            and not self.reports.wait(0)
        ):
            self.counters.idle_waits += 1
            self.reports.wait(IDLE_STEP_WAIT_S)
        done = self.reports.take()
        self.counters.loaded_chunks += done.loaded_chunks
        self.counters.failed_chunks += done.failed_chunks
        self.counters.load_seconds += done.seconds
        self._load_errors |= done.failed_blocks
        return done

    def _failed_loads(self, chunks: list[ChunkTransfer]) -> None:
        """Report chunks not loaded: vLLM recomputes their blocks."""
        for chunk in chunks:
            self._load_errors.update(chunk.block_ids[chunk.first_block :])
        self.counters.failed_chunks += len(chunks)

    def _copy_in(self, work: Sources) -> None:
        """Scatter every chunk into vLLM's KV: inline on the CPU (the csrc
        host library, all layers and chunks at once), on our stream on CUDA,
        where vLLM's stream then waits for all of it (:mod:`.device`)."""
        if not self.copies.asynchronous:
            scatter_on_host(self.layouts, work)
            return
        with self.copies.loading():
            for chunk, src in work:
                self.layouts[chunk.group].scatter(src, chunk.block_ids, chunk.first_block)

    def wait_for_layer(self, layer_name: str) -> None:
        """Nothing to wait for: a step's loads are ordered before all of its
        compute in :meth:`start_load` (vLLM's FULL graph replays call no
        per-layer hook, so an order that needed one would not hold there)."""

    def _finish_loads(self) -> None:
        """Release the leases of finished loads (waits for the copies on CUDA)."""
        if self.transfer.loads_held():
            self.copies.loads_done()
            self.transfer.release_loaded()

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
        if not self.client.write_budget:
            # The budget is learnt at HELLO: sized without it, a first save
            # (on a session not yet set up) asked for the whole step in one
            # call and the sidecar refused what went beyond its share.
            self.client.ping()
        # One call names one tenant: a step's saves go out per tenant.
        tenants: dict[str, list[RequestTransfer]] = {}
        for req in meta.saves:
            tenants.setdefault(req.tenant, []).append(req)
        for tenant, saves in tenants.items():
            self._save_requests(saves, tenant)
        self.counters.save_seconds += time.perf_counter() - started

    def _save_requests(self, saves: list[RequestTransfer], tenant: str) -> None:
        """Save the chunks of ``saves`` (requests of one tenant), per KV cache group."""
        for group, layout in enumerate(self.layouts):
            chunks = [c for req in saves for c in req.chunks if c.group == group]
            # As many chunks per round trip as the sidecar lets one session hold
            # uncommitted (it skips the rest): usually the whole step at once;
            # one PREPARE_STORE names one store choice, so one batch holds one.
            budget = self.client.write_budget  # 0 only while the sidecar cannot be reached
            batches: list[tuple[list[ChunkTransfer], int]] = []
            for tiers in dict.fromkeys(c.store_tiers for c in chunks if not c.partial):
                full = [c for c in chunks if not c.partial and c.store_tiers == tiers]
                per_call = max(1, budget // layout.chunk_nbytes) if budget else len(full) or 1
                batches += [(full[i : i + per_call], 0) for i in range(0, len(full), per_call)]
            # Partial chunks (one per prompt, its own block count): host mode only.
            for chunk in (c for c in chunks if c.partial):
                if self.transfer.saves_partial_chunks():
                    batches.append(([chunk], len(chunk.block_ids)))
                else:
                    self.counters.save_skipped_chunks += 1
            for batch, blocks in batches:
                try:
                    self._save_chunks(batch, layout, blocks, tenant)
                except Exception:
                    logger.exception("kvstrata: this step's saves failed; dropped")
                    self.counters.save_dropped_chunks += len(batch)

    def _save_chunks(
        self, chunks: list[ChunkTransfer], layout: ChunkLayout, blocks: int = 0, tenant: str = ""
    ) -> None:
        """Save chunks of one KV cache group and one tenant, all of ``blocks``
        blocks (0: full chunks), in one PREPARE_STORE + COMMIT_STORE (one
        SAVE_BLOCKS in ipc mode)."""
        done = self.transfer.save(chunks, layout, blocks, tenant)
        self.counters.saved_chunks += done.saved
        self.counters.save_skipped_chunks += done.skipped
        self.counters.save_dropped_chunks += done.dropped

    def close(self) -> None:
        if self._background is not None:
            self._background.close()
        with contextlib.suppress(Exception):
            self._finish_loads()
        self.transfer.close()
        self.client.close()
        # Our sessions have ended, and the sidecar's mappings with them.
        self._ipc_references.release()


def _caches_by_group(
    kv_caches: dict[str, torch.Tensor], groups: Sequence[KVGroup]
) -> list[dict[str, torch.Tensor]]:
    """vLLM's KV tensors split by KV cache group (all of them for one group)."""
    if len(groups) <= 1:
        return [kv_caches]
    out = []
    for group in groups:
        missing = [name for name in group.layer_names if name not in kv_caches]
        if missing:
            raise UnsupportedLayoutError(f"KV cache group {group.index}: no tensor for {missing}")
        out.append({name: kv_caches[name] for name in group.layer_names})
    return out
