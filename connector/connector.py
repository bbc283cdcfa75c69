"""``KVStrataConnector``: the vLLM KV connector (``KVConnectorBase_V1``).

A thin facade, as vLLM's own offloading connector: vLLM builds one instance
per role; the scheduler role delegates to :class:`KVStrataScheduler`
(lookups, what to load and save each step), the worker role to
:class:`KVStrataWorker` (copies between the sidecar's shared arena and the
paged KV tensors). Each role talks to the sidecar through its own
:class:`~kvstrata.connector.client.SidecarClient`.

Configuration (``kv_transfer_config.kv_connector_extra_config``):

``endpoint``               sidecar ZeroMQ endpoint (default ``ipc://$TMPDIR/kvstrata/sidecar.sock``)
``call_timeout_seconds``   deadline of one sidecar call (default 0.5)
``load_timeout_seconds``   deadline of the whole load of one request (default 5.0)
``chunk_size``             tokens per chunk, a multiple of the block size (default 256;
                           should equal the sidecar's ``chunk_size``)
``retry_interval_seconds`` while the sidecar does not answer, one call per this interval
                           (doubling, up to 8x) probes it; the others are misses (default 1.0)
``transfer_mode``          ``auto`` (default: ipc when the KV is on a GPU the sidecar sees,
                           else host), ``ipc`` or ``host``; see :mod:`kvstrata.connector.ipc`
``kv_cache_layout``        a vLLM KVCacheLayout to ask for (e.g. ``BLNHC``: cross-layer
                           blocks, one copy per block); vLLM uses it when its backends can
``curve_server_certificate`` / ``curve_client_certificate``
                           ZeroMQ CURVE certificate files (the sidecar's public one, ours
                           with its secret key) for a sidecar on a tcp:// endpoint that
                           authenticates its clients; both or neither

The cache is never the source of truth: a sidecar that is down, slow or
restarting costs misses and dropped saves, never an exception or a hang.
A load that fails after the scheduler counted a hit is reported through
``get_block_ids_with_load_errors`` and vLLM recomputes those tokens; for
that the connector sets ``kv_load_failure_policy`` to ``"recompute"``.
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvstrata.connector.client import CurveKeys
from kvstrata.connector.layout import dtype_name, layout_id
from kvstrata.connector.metadata import KVStrataMetadata
from kvstrata.sidecar.keys import Namespace

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

    from kvstrata.connector.scheduler import KVStrataScheduler, SchedulerCounters
    from kvstrata.connector.worker import KVStrataWorker, WorkerCounters

logger = logging.getLogger(__name__)

DEFAULT_CHUNK_SIZE = 256


@dataclass(frozen=True, slots=True)
class ConnectorSettings:
    """The connector's settings, read once from vLLM's config."""

    endpoint: str
    call_timeout_s: float
    load_timeout_s: float
    retry_interval_s: float
    chunk_size: int
    block_size: int
    num_blocks: int  # vLLM's KV cache blocks (its kernels may split them further)
    kv_cache_layout: str | None  # vLLM's resolved KVCacheLayout name
    layout: str | None  # namespace layout string; None: unknown layout (connector disabled)
    transfer_mode: str  # "auto" (ipc for CUDA KV where the sidecar can), "ipc" or "host"
    namespace: Namespace  # with tp_rank 0; the worker substitutes its own rank
    curve: CurveKeys | None = None  # CURVE keys for an authenticated tcp:// sidecar

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk_size // self.block_size


def _float(extra: dict[str, Any], key: str, default: float) -> float:
    value = extra.get(key, default)
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise ValueError(
            f"kv_connector_extra_config.{key} must be a number, not {value!r}"
        ) from None
    if out <= 0:
        raise ValueError(f"kv_connector_extra_config.{key} must be > 0, not {value!r}")
    return out


def settings_from_config(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
) -> ConnectorSettings:
    """Read and check the connector's settings; ValueError names a bad key."""
    from vllm.platforms import current_platform

    extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
    endpoint = str(extra.get("endpoint") or f"ipc://{tempfile.gettempdir()}/kvstrata/sidecar.sock")
    groups = kv_cache_config.kv_cache_groups
    kv_cache_layout = getattr(kv_cache_config, "kv_cache_layout", None)
    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    layout = layout_id(
        current_platform.device_type,
        kv_cache_layout,
        getattr(backend, "name", None) if backend is not None else None,
    )
    if layout is None:
        logger.warning("kvstrata: vLLM names no KV cache layout: connector disabled")
    if len(groups) != 1:
        logger.warning(
            "kvstrata: %d KV cache groups (hybrid model): connector disabled", len(groups)
        )
        layout = None
    spec = groups[0].kv_cache_spec if groups else None
    block_size = int(getattr(spec, "block_size", vllm_config.cache_config.block_size))
    transfer_mode = str(extra.get("transfer_mode", "auto"))
    if transfer_mode not in ("auto", "ipc", "host"):
        raise ValueError(
            "kv_connector_extra_config.transfer_mode must be auto, ipc or host, "
            f"not {transfer_mode!r}"
        )
    chunk_size = int(extra.get("chunk_size", DEFAULT_CHUNK_SIZE))
    if chunk_size < 1:
        raise ValueError(f"kv_connector_extra_config.chunk_size must be >= 1, not {chunk_size}")
    if chunk_size % block_size:
        rounded = -(-chunk_size // block_size) * block_size
        logger.warning(
            "kvstrata: chunk_size %d is not a multiple of the block size %d; using %d",
            chunk_size,
            block_size,
            rounded,
        )
        chunk_size = rounded
    model = vllm_config.model_config
    cache_dtype = vllm_config.cache_config.cache_dtype
    kv_dtype = dtype_name(model.dtype) if cache_dtype == "auto" else str(cache_dtype)
    parallel = vllm_config.parallel_config
    namespace = Namespace(
        model=str(model.model),
        revision=str(model.revision or ""),
        kv_dtype=kv_dtype,
        layout=layout or "unsupported",
        block_size=block_size,
        chunk_size=chunk_size,
        tp_rank=0,
        tp_size=int(parallel.tensor_parallel_size),
        pp_rank=0,
        pp_size=int(parallel.pipeline_parallel_size),
    )
    certificates = (extra.get("curve_server_certificate"), extra.get("curve_client_certificate"))
    if (certificates[0] is None) != (certificates[1] is None):
        raise ValueError(
            "kv_connector_extra_config.curve_server_certificate and curve_client_certificate "
            "go together"
        )
    curve = None
    if certificates[0] is not None:
        curve = CurveKeys.load(str(certificates[0]), str(certificates[1]))
    return ConnectorSettings(
        curve=curve,
        endpoint=endpoint,
        call_timeout_s=_float(extra, "call_timeout_seconds", 0.5),
        load_timeout_s=_float(extra, "load_timeout_seconds", 5.0),
        retry_interval_s=_float(extra, "retry_interval_seconds", 1.0),
        transfer_mode=transfer_mode,
        chunk_size=chunk_size,
        block_size=block_size,
        num_blocks=int(kv_cache_config.num_blocks),
        kv_cache_layout=kv_cache_layout,
        layout=layout,
        namespace=namespace,
    )


class KVStrataConnector(KVConnectorBase_V1):
    """Tiered KV cache through a local kvstrata sidecar (host transfer mode).

    Loads are synchronous (``get_num_new_matched_tokens`` answers
    ``load_is_async=False``): in host mode a load is a memory copy from the
    shared arena into the paged KV, far shorter than a scheduler step, and
    the lookup already asked the sidecar to prefetch L2/L3 chunks into L1.
    An asynchronous load would park the request for at least one extra
    step. Saves are synchronous too, at ``wait_for_save``, so no block is
    ever held past a step and ``request_finished`` never delays a free.
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        if transfer.kv_load_failure_policy != "recompute":
            # A failed load (sidecar gone between lookup and load) must cost a
            # recompute, never a failed request.
            logger.info("kvstrata: setting kv_load_failure_policy=recompute")
            transfer.kv_load_failure_policy = "recompute"
        self.settings = settings_from_config(vllm_config, kv_cache_config)
        self._scheduler: KVStrataScheduler | None = None
        self._worker: KVStrataWorker | None = None
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

    @property
    def counters(self) -> SchedulerCounters | WorkerCounters:
        """This role's counters (hits, loads, saves, failures)."""
        if self._scheduler is not None:
            return self._scheduler.counters
        assert self._worker is not None  # one role is always built
        return self._worker.counters

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
        # On CUDA, vLLM's stream waits for this layer's copies only; on the
        # CPU every layer was loaded in start_load_kv.
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
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors() if self._worker is not None else set()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.close()

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
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens), False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if self._scheduler is not None:
            self._scheduler.update_state_after_alloc(
                request, blocks.get_block_ids()[0], num_external_tokens
            )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        if self._scheduler is None:
            return KVStrataMetadata()
        return self._scheduler.build_connector_meta(scheduler_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        if self._scheduler is not None:
            self._scheduler.request_finished(request.request_id)
        return False, None
