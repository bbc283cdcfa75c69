"""``KVStrataConnector``: the vLLM KV connector (``KVConnectorBase_V1``).

A thin facade, as vLLM's own offloading connector: vLLM builds one instance
per role; the scheduler role delegates to :class:`KVStrataScheduler`
(lookups, what to load and save each step), the worker role to
:class:`KVStrataWorker` (copies between the sidecar's shared arena and the
paged KV tensors). Each role talks to the sidecar through its own
:class:`~kvstrata.connector.client.SidecarClient`.

Configuration: the ``kv_connector_extra_config`` keys, read and checked by
:mod:`kvstrata.connector.settings`.

The cache is never the source of truth: a sidecar that is down, slow or
restarting costs misses and dropped saves, never an exception or a hang.
A load that fails after the scheduler counted a hit is reported through
``get_block_ids_with_load_errors`` (or, for a hybrid model's background
load, as a failed receive) and vLLM recomputes those tokens, when the
transfer config says ``kv_load_failure_policy: recompute`` (the webhook
and ``kvstrata demo`` write it; the scheduler role warns once without it).

Loads: a hit in L1 loads before the step's forward pass; one that reaches
below L1 loads in the background (``load_kv_async``): vLLM parks the
request and schedules it once the workers report it through
``get_finished`` (:mod:`kvstrata.connector.async_loads`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from kvstrata.connector.metadata import KVStrataMetadata
from kvstrata.connector.settings import settings_from_config
from kvstrata.connector.stats import KVStrataPromMetrics, KVStrataStats, StatsDelta
from kvstrata.connector.transfer_config import LOAD_FAILURE_POLICY

if TYPE_CHECKING:
    from collections.abc import Iterable

    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from kvstrata.connector.scheduler import KVStrataScheduler
    from kvstrata.connector.scheduler_state import SchedulerCounters
    from kvstrata.connector.worker import KVStrataWorker, WorkerCounters

logger = logging.getLogger(__name__)


def hit_sources(tokens_by_tier: dict[str, int], total: int) -> dict[CacheHitSource, int]:
    """kvstrata tiers as vLLM's cache-hit sources; the counts sum to ``total``."""
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    tier_source = {"l1": CacheHitSource.HOST, "l2": CacheHitSource.DISK}
    out: dict[CacheHitSource, int] = {}
    for tier, n in tokens_by_tier.items():
        source = tier_source.get(tier, CacheHitSource.EXTERNAL_UNSPECIFIED)
        out[source] = out.get(source, 0) + n
    rest = total - sum(out.values())
    if rest > 0:
        unspecified = CacheHitSource.EXTERNAL_UNSPECIFIED
        out[unspecified] = out.get(unspecified, 0) + rest
    elif rest < 0:  # never expected: report the total, all unspecified, not a wrong split
        out = {CacheHitSource.EXTERNAL_UNSPECIFIED: total}
    return {k: v for k, v in out.items() if v > 0}


def load_failure_policy_warning(transfer: Any) -> str | None:
    """Why the transfer config puts requests at risk, or None.

    The connector does not change vLLM's config: it is the user's (the webhook
    and ``kvstrata demo`` render ``kv_load_failure_policy: recompute``). With
    vLLM's default (``fail``), a cache load that fails after a hit -- sidecar
    restarted between lookup and load, a corrupt object -- fails the request
    instead of costing a recompute.
    """
    policy = getattr(transfer, "kv_load_failure_policy", None)
    if policy == LOAD_FAILURE_POLICY:
        return None
    return (
        f"kvstrata: kv_load_failure_policy is {policy!r}: a failed cache load will fail its "
        f'request. Add "kv_load_failure_policy": "{LOAD_FAILURE_POLICY}" to '
        "--kv-transfer-config so that it costs a recompute instead."
    )


class KVStrataConnector(KVConnectorBase_V1, SupportsHMA):
    """Tiered KV cache through a local kvstrata sidecar (host or ipc transfer mode).

    Loads: a hit whose chunks are all in L1 loads before the step's forward
    pass (``get_num_new_matched_tokens`` answers ``load_is_async=False``);
    a hit that reaches below L1 (L2 disk, the shared tier) loads in the
    background (``load_is_async=True``): vLLM parks the request until the
    workers report it through ``get_finished``, and schedules other work
    meanwhile. The ``load_async`` extra-config key overrides this
    (``always`` / ``never``); hybrid models always load in the background.

    Transfer modes (``transfer_mode``; ``auto`` picks ipc when the KV cache
    is on a GPU the sidecar can open): in ``host`` mode the workers copy
    between vLLM's paged KV and the sidecar's shared-memory arena; in
    ``ipc`` mode they register CUDA IPC handles of their KV tensors once and
    the sidecar runs the copies on the GPU (SAVE_BLOCKS / LOAD_BLOCKS); a
    sidecar that cannot serve ipc grants host mode instead, saying why.

    Saves are synchronous, at ``wait_for_save``, so no block is held past
    its step and ``request_finished`` never delays a free (it answers
    ``False``).

    Hybrid models keep vLLM's hybrid allocator (``SupportsHMA``): each KV
    cache group is saved and loaded with its own block ids under its own
    namespace (:mod:`kvstrata.connector.settings`), and a hit is a prefix
    every group holds; vLLM then calls :meth:`request_finished_all_groups`.
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        if role == KVConnectorRole.SCHEDULER:  # the scheduler applies the policy: warn once
            warning = load_failure_policy_warning(vllm_config.kv_transfer_config)
            if warning:
                logger.warning(warning)
        self.settings = settings_from_config(vllm_config, kv_cache_config)
        self._scheduler: KVStrataScheduler | None = None
        self._worker: KVStrataWorker | None = None
        self._stats = StatsDelta()
        if role == KVConnectorRole.SCHEDULER:
            from kvstrata.connector.scheduler import KVStrataScheduler

            self._scheduler = KVStrataScheduler(self.settings)
        else:
            from kvstrata.connector.worker import KVStrataWorker

            self._worker = KVStrataWorker(self.settings, vllm_config)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """The ``kv_cache_layout`` extra-config key, if set (vLLM falls back
        with a warning when its attention backends cannot use it)."""
        transfer = vllm_config.kv_transfer_config
        extra = (transfer.kv_connector_extra_config if transfer is not None else None) or {}
        layout = extra.get("kv_cache_layout")
        return str(layout) if layout else None

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """No: vLLM keeps full CUDA graphs for decode batches.

        A full graph's replay runs no Python hook, so ``wait_for_layer_load``
        cannot order attention after a load there; and vLLM 0.32's V2 model
        runner calls ``start_load_kv`` outside any forward context for such a
        step, so the step's graph mode cannot be read from it either. Instead
        :meth:`start_load_kv` makes vLLM's stream wait for the whole load
        before it returns, whatever the runner and graph mode
        (:mod:`kvstrata.connector.device`): every mode is ordered the same
        way, and full graphs stay for every decode step.
        """
        return False

    @property
    def counters(self) -> SchedulerCounters | WorkerCounters:
        """This role's counters (hits, loads, saves, failures)."""
        if self._scheduler is not None:
            return self._scheduler.counters
        assert self._worker is not None  # one role is always built
        return self._worker.counters

    # -- vLLM's metrics (both roles) ---------------------------------------------

    def get_kv_connector_stats(self) -> KVStrataStats | None:
        """What this role did since the last call (None if nothing): vLLM sums the
        roles' and workers' reports and passes them to :meth:`build_prom_metrics`'s
        object and its log line."""
        return self._stats.take(self._figures())

    def _figures(self) -> dict[str, Any]:
        if self._scheduler is not None:
            c = self._scheduler.counters
            return {
                "lookups": c.lookups,
                "lookup_failures": c.lookup_failures,
                "hit_tokens": dict(c.hit_tokens_by_tier),
            }
        assert self._worker is not None
        w = self._worker.counters
        layout = self._worker.layout
        chunk_bytes = layout.chunk_nbytes if layout is not None else 0
        return {
            "loaded_chunks": w.loaded_chunks,
            "load_failed_chunks": w.failed_chunks,
            "saved_chunks": w.saved_chunks,
            "save_dropped_chunks": w.save_dropped_chunks,
            "loaded_bytes": w.loaded_chunks * chunk_bytes,
            "saved_bytes": w.saved_chunks * chunk_bytes,
            "load_seconds": w.load_seconds,
            "save_seconds": w.save_seconds,
        }

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVStrataStats:
        return KVStrataStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVStrataPromMetrics:
        return KVStrataPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @property
    def requires_kv_delivery(self) -> bool:
        # A dropped save is only a future miss.
        return False

    # -- worker role ----------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self._worker is not None:
            self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self._worker is not None:
            self._worker.start_load(self._bound_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Every layer was loaded (CPU) or ordered before vLLM's compute (CUDA)
        # in start_load_kv: nothing is left to wait for here.
        if self._worker is not None:
            self._worker.wait_for_layer(layer_name)

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        # Host mode saves every layer at once in wait_for_save.
        return

    def wait_for_save(self) -> None:
        if self._worker is not None:
            self._worker.save(self._bound_metadata())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose background load finished (failed ones too: their
        blocks are among this pass's load errors). No save is ever delayed."""
        if self._worker is None:
            return None, None
        return None, self._worker.take_finished(self._idle_step()).req_ids or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """As :meth:`get_finished`, and the requests to recompute whole: a
        hybrid model's load that missed anything (vLLM cannot take block-level
        errors with several KV cache groups)."""
        if self._worker is None:
            return KVConnectorTransferResults()
        done = self._worker.take_finished(self._idle_step())
        return KVConnectorTransferResults(
            finished_recving=done.req_ids, failed_recving=done.failed_req_ids
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors() if self._worker is not None else set()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.close()

    def _idle_step(self) -> bool:
        meta = self._bound_metadata()
        return meta is not None and meta.idle

    def _bound_metadata(self) -> KVStrataMetadata | None:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        return meta if isinstance(meta, KVStrataMetadata) else None

    # -- scheduler role ---------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if self._scheduler is None:
            return 0, False
        matched = self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)
        return matched, bool(matched) and self._scheduler.loads_async(request.request_id)

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        """The load's tokens by source for vLLM's
        ``vllm:prompt_tokens_cached_by_source``: L1 is ``host`` memory, L2
        ``disk``, a shared tier ``external_unspecified`` (vLLM has no remote
        source); what the plan does not account for is unspecified too."""
        if self._scheduler is None or num_external_tokens <= 0:
            return {}
        return hit_sources(
            self._scheduler.load_tokens_by_tier(request.request_id), num_external_tokens
        )

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if self._scheduler is not None:
            self._scheduler.update_state_after_alloc(
                request, blocks.get_block_ids(), num_external_tokens
            )

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """The workers' reports of this step: background loads that finished or failed."""
        if self._scheduler is not None and connector_output.finished_recving:
            self._scheduler.background_loads_finished(
                set(connector_output.finished_recving),
                set(connector_output.failed_recving or ()),
                set(connector_output.invalid_block_ids or ()),
            )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        if self._scheduler is None:
            return KVStrataMetadata()
        return self._scheduler.build_connector_meta(scheduler_output)

    def take_events(self) -> Iterable[KVCacheEvent]:
        """The sidecar's tier changes as vLLM KV events (``--kv-events-config``):
        BlockStored / BlockRemoved per tier (:mod:`kvstrata.connector.events`)."""
        return self._scheduler.take_events() if self._scheduler is not None else ()

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        if self._scheduler is not None:
            self._scheduler.request_finished(request.request_id)
        return False, None

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's hook under its hybrid allocator (once, before every group's
        blocks are freed): as :meth:`request_finished`; never delays a free."""
        return self.request_finished(request, block_ids[0] if block_ids else [])
