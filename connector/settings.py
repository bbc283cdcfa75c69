"""The connector's settings, read once from vLLM's config and checked.

Kept apart from the connector as vLLM keeps its connectors' configs apart:
the scheduler and worker roles take a :class:`ConnectorSettings` and never
read vLLM's config for these values themselves.

Configuration: the keys of ``kv_transfer_config.kv_connector_extra_config``
are :data:`EXTRA_CONFIG_KEYS`, rendered into ``docs/connector.md`` by
``make docs``; a key not among them stops vLLM at start, naming it.

Hybrid models (several KV cache groups under vLLM's hybrid allocator, e.g.
Gemma-2's sliding-window + full-attention layers): every group is stored
under a namespace of its own (the layout string ends in ``:g<i>-full`` or
``:g<i>-swa<window>``), one object per (chunk, group), so each group's layers
copy with that group's block ids; see :class:`KVGroup`. A single group keeps
the plain namespace. Groups of other kinds (Mamba, chunked local attention,
...) disable the connector.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from enum import Enum
from typing import TYPE_CHECKING, Any

from kvstrata.connector.layout import dtype_name, layout_id
from kvstrata.connector.transport import CurveKeys
from kvstrata.sidecar.endpoint import default_endpoint
from kvstrata.sidecar.keys import Namespace
from kvstrata.sidecar.transfer_mode import ModeSetting, parse

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger(__name__)

DEFAULT_CHUNK_SIZE = 256


class LoadAsync(Enum):
    """When a hit loads in the background (vLLM's ``load_kv_async``): the
    ``load_async`` key, parsed once here; the scheduler compares members."""

    # When a chunk of the hit is below L1 (it must come up from disk or the
    # shared tier first); hybrid models load every hit in the background.
    AUTO = "auto"
    ALWAYS = "always"
    NEVER = "never"


@dataclass(frozen=True, slots=True)
class ExtraConfigKey:
    """One key of ``kv_connector_extra_config``: its default as text and what it does."""

    name: str
    default: str
    description: str


EXTRA_CONFIG_KEYS: tuple[ExtraConfigKey, ...] = (
    ExtraConfigKey(
        "endpoint",
        "`ipc://$TMPDIR/kvstrata/sidecar.sock`",
        "the sidecar's ZeroMQ endpoint: `ipc://PATH`, `ipc://@NAME` (abstract socket) "
        "or `tcp://HOST:PORT`",
    ),
    ExtraConfigKey("call_timeout_seconds", "0.5", "deadline of one sidecar call"),
    ExtraConfigKey("load_timeout_seconds", "5.0", "deadline of the whole load of one request"),
    ExtraConfigKey(
        "lookup_wait_seconds",
        "0.005",
        "how long vLLM's scheduler waits, in all per step, for new requests' lookups "
        "before it moves on and asks again at its next step (0: never waits)",
    ),
    ExtraConfigKey(
        "chunk_size",
        str(DEFAULT_CHUNK_SIZE),
        "tokens per chunk, rounded up to a multiple of the block size; should equal the "
        "sidecar's `chunk_size`",
    ),
    ExtraConfigKey(
        "transfer_mode",
        "`auto`",
        "`auto` (ipc when the KV cache is on a GPU the sidecar sees, else host), `ipc` "
        "(CUDA IPC: the sidecar copies straight into the KV cache) or `host` (copies "
        "through the shared-memory arena)",
    ),
    ExtraConfigKey(
        "load_async",
        "`auto`",
        "`auto` (a hit that reaches below L1 loads in the background while vLLM schedules "
        "other work), `always` or `never`; hybrid models always load in the background",
    ),
    ExtraConfigKey(
        "kv_cache_layout",
        "unset",
        "a vLLM KVCacheLayout to ask for (e.g. `BLNHC`: cross-layer blocks, one copy per "
        "block); vLLM uses it when its attention backends can",
    ),
    ExtraConfigKey(
        "curve_server_certificate",
        "unset",
        "the sidecar's public ZeroMQ CURVE certificate file, for a sidecar on a `tcp://` "
        "endpoint that authenticates its clients; set with `curve_client_certificate`",
    ),
    ExtraConfigKey(
        "curve_client_certificate",
        "unset",
        "this client's CURVE certificate file with its secret key (as `zmq.auth` writes "
        "it); set with `curve_server_certificate`",
    ),
)
KNOWN_KEYS = frozenset(key.name for key in EXTRA_CONFIG_KEYS)


def check_known_keys(extra: dict[str, Any]) -> None:
    """ValueError naming every key of ``extra`` the connector does not read, and
    the keys it does: a misspelt key would otherwise be silently ignored."""
    unknown = sorted(str(key) for key in extra if key not in KNOWN_KEYS)
    if unknown:
        known = ", ".join(key.name for key in EXTRA_CONFIG_KEYS)
        raise ValueError(
            f"kv_connector_extra_config: unknown key(s) {', '.join(map(repr, unknown))}; "
            f"the kvstrata connector reads {known}"
        )


@dataclass(frozen=True, slots=True)
class KVGroup:
    """One of vLLM's KV cache groups, as the connector stores it.

    ``sliding_window`` is None for full attention. Under vLLM's hybrid
    allocator a sliding-window group's blocks before its window are vLLM's
    null block (:data:`NULL_BLOCK_ID`): never saved from, never loaded into.
    """

    index: int
    layer_names: tuple[str, ...]
    sliding_window: int | None
    namespace: Namespace  # with tp_rank 0, as ConnectorSettings.namespace

    def skipped_blocks(self, num_computed_tokens: int, block_size: int) -> int:
        """Leading blocks vLLM has freed (made null) once ``num_computed_tokens``
        are computed: those before the window of the next token."""
        if self.sliding_window is None:
            return 0
        return max(0, num_computed_tokens - self.sliding_window + 1) // block_size


NULL_BLOCK_ID = 0  # vLLM's null block: the first block its BlockPool hands out


@dataclass(frozen=True, slots=True)
class ConnectorSettings:
    """The connector's settings, read once from vLLM's config."""

    endpoint: str
    call_timeout_s: float
    load_timeout_s: float
    chunk_size: int
    block_size: int
    num_blocks: int  # vLLM's KV cache blocks (its kernels may split them further)
    kv_cache_layout: str | None  # vLLM's resolved KVCacheLayout name
    layout: str | None  # namespace layout string; None: unknown layout (connector disabled)
    transfer_mode: ModeSetting  # AUTO (ipc for CUDA KV where the sidecar can), IPC or HOST
    namespace: Namespace  # with tp_rank 0; the worker substitutes its own rank
    curve: CurveKeys | None = None  # CURVE keys for an authenticated tcp:// sidecar
    # vLLM's KV cache groups; one (namespace == ``namespace``) unless hybrid.
    groups: tuple[KVGroup, ...] = ()
    # vLLM publishes KV events (--kv-events-config): the sidecar records its
    # tiers' changes for them from this client's HELLO on.
    kv_events: bool = False
    load_async: LoadAsync = LoadAsync.AUTO
    lookup_wait_s: float = 0.005  # the scheduler's wait for a new lookup's answer

    def __post_init__(self) -> None:
        # A string here (a caller building settings by hand) would compare
        # unequal to every member and silently mean "never"; refuse it.
        if not isinstance(self.load_async, LoadAsync):
            raise TypeError(f"load_async must be a LoadAsync member, not {self.load_async!r}")
        if not isinstance(self.transfer_mode, ModeSetting):
            raise TypeError(
                f"transfer_mode must be a ModeSetting member, not {self.transfer_mode!r}"
            )

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk_size // self.block_size


def settings_from_config(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
) -> ConnectorSettings:
    """Read and check the connector's settings; ValueError names a bad key."""
    extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
    check_known_keys(extra)
    endpoint = str(extra.get("endpoint") or default_endpoint())
    kv_cache_layout = getattr(kv_cache_config, "kv_cache_layout", None)
    layout = _layout(vllm_config, kv_cache_layout)
    groups = kv_cache_config.kv_cache_groups
    spec = groups[0].kv_cache_spec if groups else None
    block_size = int(getattr(spec, "block_size", vllm_config.cache_config.block_size))
    asked = str(extra.get("transfer_mode", ModeSetting.AUTO.value))
    transfer_mode = parse(ModeSetting, asked, "kv_connector_extra_config.transfer_mode")
    chunk_size = _chunk_size(extra, block_size)
    namespace = _namespace(vllm_config, layout, block_size, chunk_size)
    kv_groups = _groups(kv_cache_config, namespace) if layout is not None else ()
    if layout is not None and not kv_groups:
        layout = None
        namespace = _namespace(vllm_config, layout, block_size, chunk_size)
    curve = _curve(extra)
    return ConnectorSettings(
        curve=curve,
        endpoint=endpoint,
        call_timeout_s=_float(extra, "call_timeout_seconds", 0.5),
        load_timeout_s=_float(extra, "load_timeout_seconds", 5.0),
        lookup_wait_s=_float(extra, "lookup_wait_seconds", 0.005, zero_ok=True),
        transfer_mode=transfer_mode,
        chunk_size=chunk_size,
        block_size=block_size,
        num_blocks=int(kv_cache_config.num_blocks),
        kv_cache_layout=kv_cache_layout,
        layout=layout,
        namespace=namespace,
        groups=kv_groups,
        kv_events=events_enabled(vllm_config),
        load_async=_member(extra, "load_async", LoadAsync.AUTO),
    )


def events_enabled(vllm_config: Any) -> bool:
    """Whether vLLM publishes KV events (``--kv-events-config``)."""
    config = getattr(vllm_config, "kv_events_config", None)
    return bool(config is not None and getattr(config, "enable_kv_cache_events", False))


def _groups(kv_cache_config: KVCacheConfig, namespace: Namespace) -> tuple[KVGroup, ...]:
    """The KV cache groups with their namespaces; () (connector disabled, with a
    warning) for a hybrid model with a group kind the connector cannot store."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec

    groups = kv_cache_config.kv_cache_groups
    if len(groups) <= 1:
        names = tuple(groups[0].layer_names) if groups else ()
        return (KVGroup(0, names, None, namespace),)
    out: list[KVGroup] = []
    block_size = None
    for i, group in enumerate(groups):
        spec = group.kv_cache_spec
        if isinstance(spec, SlidingWindowSpec):
            window: int | None = int(spec.sliding_window)
            kind = f"swa{window}"
        elif type(spec) in (FullAttentionSpec, MLAAttentionSpec):
            window, kind = None, "full"
        else:
            logger.warning(
                "kvstrata: KV cache group %d is %s, which the connector cannot store: "
                "connector disabled",
                i,
                type(spec).__name__,
            )
            return ()
        if block_size is not None and spec.block_size != block_size:
            logger.warning("kvstrata: KV cache groups of different block sizes: disabled")
            return ()
        block_size = spec.block_size
        group_ns = replace(namespace, layout=f"{namespace.layout}:g{i}-{kind}")
        out.append(KVGroup(i, tuple(group.layer_names), window, group_ns))
    return tuple(out)


def _layout(vllm_config: VllmConfig, kv_cache_layout: str | None) -> str | None:
    """The namespace layout string, or None (connector disabled, with a warning)
    for a layout vLLM does not name."""
    from vllm.platforms import current_platform

    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    layout = layout_id(
        current_platform.device_type,
        kv_cache_layout,
        getattr(backend, "name", None) if backend is not None else None,
    )
    if layout is None:
        logger.warning("kvstrata: vLLM names no KV cache layout: connector disabled")
    return layout


def _member(extra: dict[str, Any], key: str, default: LoadAsync) -> LoadAsync:
    """The member of ``default``'s enum that ``extra[key]`` names; ValueError
    names the key, the value and the allowed ones."""
    value = str(extra.get(key, default.value))
    for member in type(default):
        if member.value == value:
            return member
    allowed = ", ".join(m.value for m in type(default))
    raise ValueError(f"kv_connector_extra_config.{key} must be one of {allowed}, not {value!r}")


def _chunk_size(extra: dict[str, Any], block_size: int) -> int:
    """``chunk_size``, rounded up to a multiple of the block size (with a warning)."""
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
    return chunk_size


def _namespace(
    vllm_config: VllmConfig, layout: str | None, block_size: int, chunk_size: int
) -> Namespace:
    """The key namespace of this model and KV format, with rank 0 (see ConnectorSettings)."""
    model = vllm_config.model_config
    cache_dtype = vllm_config.cache_config.cache_dtype
    kv_dtype = dtype_name(model.dtype) if cache_dtype == "auto" else str(cache_dtype)
    parallel = vllm_config.parallel_config
    return Namespace(
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


def _curve(extra: dict[str, Any]) -> CurveKeys | None:
    """The CURVE keys from their two certificate files, or None when neither is set."""
    certificates = (extra.get("curve_server_certificate"), extra.get("curve_client_certificate"))
    if (certificates[0] is None) != (certificates[1] is None):
        raise ValueError(
            "kv_connector_extra_config.curve_server_certificate and curve_client_certificate "
            "go together"
        )
    if certificates[0] is None:
        return None
    return CurveKeys.load(str(certificates[0]), str(certificates[1]))


def _float(extra: dict[str, Any], key: str, default: float, *, zero_ok: bool = False) -> float:
    """A positive number (or 0 where ``zero_ok``) from the extra config;
    ValueError names the key."""
    value = extra.get(key, default)
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise ValueError(
            f"kv_connector_extra_config.{key} must be a number, not {value!r}"
        ) from None
    if out < 0 or (out == 0 and not zero_ok) or math.isnan(out):
        bound = ">= 0" if zero_ok else "> 0"
        raise ValueError(f"kv_connector_extra_config.{key} must be {bound}, not {value!r}")
    if math.isinf(out):  # no wait or deadline takes it (threading: OverflowError)
        raise ValueError(f"kv_connector_extra_config.{key} must be finite, not {value!r}")
    return out


def rank_namespaces(namespace: Namespace) -> list[Namespace]:
    """The namespace of every TP/PP rank of the engine, rank (0, 0) first."""
    return [
        replace(namespace, tp_rank=tp, pp_rank=pp)
        for pp in range(max(1, namespace.pp_size))
        for tp in range(max(1, namespace.tp_size))
    ]
