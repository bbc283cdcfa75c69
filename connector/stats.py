"""The connector's figures in vLLM's own metrics: its logs and its ``/metrics``.

vLLM collects connector stats every step from both roles
(``get_kv_connector_stats``: the workers' ride in the model runner output, the
scheduler's are added in ``update_from_output``), sums them with
:meth:`KVStrataStats.aggregate`, and hands the sum to its stat loggers: the
periodic log line (``KV Transfer metrics: ...``, from :meth:`reduce`) and,
through ``build_prom_metrics``, :class:`KVStrataPromMetrics`, which adds the
counts to ``vllm:kvstrata_*`` counters labelled like vLLM's own metrics
(model name, engine). So an operator reads kvstrata's hits per tier, bytes
moved and load failures where they read vLLM's throughput, without the
sidecar.

Each role reports what changed since its last report (:class:`StatsDelta`);
the payload is a plain dict of numbers so that it pickles between processes.

``data`` keys: ``lookups``, ``lookup_failures``, ``hit_tokens`` ({tier:
tokens}), ``loaded_chunks``, ``load_failed_chunks`` (chunks a lookup promised
that the worker could not load: vLLM recomputed them), ``saved_chunks``,
``save_dropped_chunks``, ``loaded_bytes``, ``saved_bytes``, ``load_seconds``,
``save_seconds``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

# (data key, Prometheus name after "vllm:", help) of the plain counters.
COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("lookups", "kvstrata_lookups", "kvstrata lookups the scheduler made"),
    ("lookup_failures", "kvstrata_lookup_failures",
     "kvstrata lookups that failed or timed out (counted as misses)"),
    ("loaded_chunks", "kvstrata_loaded_chunks", "chunks loaded from the kvstrata sidecar"),
    ("load_failed_chunks", "kvstrata_load_failed_chunks",
     "chunks a kvstrata lookup promised that could not be loaded (vLLM recomputed them)"),
    ("saved_chunks", "kvstrata_saved_chunks", "chunks saved into the kvstrata sidecar"),
    ("save_dropped_chunks", "kvstrata_save_dropped_chunks",
     "chunks whose save was dropped (sidecar unavailable or busy)"),
    ("loaded_bytes", "kvstrata_loaded_bytes", "KV bytes loaded from the kvstrata sidecar"),
    ("saved_bytes", "kvstrata_saved_bytes", "KV bytes saved into the kvstrata sidecar"),
    ("load_seconds", "kvstrata_load_seconds", "seconds the workers spent loading KV"),
    ("save_seconds", "kvstrata_save_seconds", "seconds the workers spent saving KV"),
)  # fmt: skip
HIT_TOKENS = (
    "hit_tokens",
    "kvstrata_hit_tokens",
    "tokens loaded from kvstrata, by the tier holding them: whole chunks and the blocks of a "
    "partial chunk (the sidecar's kvstrata_hit_tokens_total counts whole chunks only)",
)
# Tiers every sidecar has: their hit series are served from the start, at 0,
# so a hit rate reads 0 before the first hit (a shared tier's appear with its first).
STANDING_TIERS = ("l1", "l2")


@dataclass
class KVStrataStats(KVConnectorStats):
    """Counts of one interval, summed over roles and workers (see the module docstring)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVStrataStats:
        for key, value in other.data.items():
            if key == HIT_TOKENS[0]:
                tiers = self.data.setdefault(key, {})
                for tier, n in value.items():
                    tiers[tier] = tiers.get(tier, 0) + n
            else:
                self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for key, _, _ in COUNTERS:
            if key in self.data:
                value = self.data[key]
                out[key] = round(value, 3) if isinstance(value, float) else value
        for tier, n in sorted(self.data.get(HIT_TOKENS[0], {}).items()):
            out[f"hit_tokens_{tier}"] = n
        return out

    def is_empty(self) -> bool:
        hits = self.data.get(HIT_TOKENS[0], {})
        return not any(v for k, v in self.data.items() if k != HIT_TOKENS[0]) and not any(
            hits.values()
        )


class StatsDelta:
    """What changed in a role's cumulative counters since the last :meth:`take`."""

    def __init__(self) -> None:
        self._last: dict[str, Any] = {}

    def take(self, now: dict[str, Any]) -> KVStrataStats | None:
        """``now``: the role's cumulative figures, in ``data`` keys. None when nothing moved."""
        delta: dict[str, Any] = {}
        for key, value in now.items():
            if isinstance(value, dict):
                last = self._last.get(key, {})
                moved = {t: n - last.get(t, 0) for t, n in value.items() if n != last.get(t, 0)}
                if moved:
                    delta[key] = moved
            elif value != self._last.get(key, 0):
                delta[key] = value - self._last.get(key, 0)
        self._last = {k: dict(v) if isinstance(v, dict) else v for k, v in now.items()}
        return KVStrataStats(data=delta) if delta else None


class KVStrataPromMetrics(KVConnectorPromMetrics):
    """``vllm:kvstrata_*`` counters on vLLM's ``/metrics``, per engine."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, Any] = {}
        for key, name, doc in COUNTERS:
            self._counters[key] = self._counter_cls(
                name=f"vllm:{name}", documentation=doc, labelnames=labelnames
            )
        key, name, doc = HIT_TOKENS
        self._hits = self._counter_cls(
            name=f"vllm:{name}", documentation=doc, labelnames=[*labelnames, "tier"]
        )
        # Zero series from the start for every engine, so rates never read "no data".
        for labelvalues in per_engine_labelvalues.values():
            for counter in self._counters.values():
                counter.labels(*labelvalues)
            for tier in STANDING_TIERS:
                self._hits.labels(*labelvalues, tier)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labelvalues = self.per_engine_labelvalues[engine_idx]
        for key, value in transfer_stats_data.items():
            if key == HIT_TOKENS[0]:
                for tier, n in value.items():
                    if n > 0:
                        self._hits.labels(*labelvalues, str(tier)).inc(n)
            elif key in self._counters and value > 0:
                self._counters[key].labels(*labelvalues).inc(value)
