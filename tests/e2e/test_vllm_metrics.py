"""The connector's figures reach vLLM's own metrics (``vllm:kvstrata_*``).

vLLM collects ``get_kv_connector_stats`` from both connector roles every step
and adds them to its Prometheus counters through ``build_prom_metrics``; the
test reads them back from vLLM's own metrics snapshot (``LLM.get_metrics``,
the registry its ``/metrics`` serves) and compares them with what the
connector counted over the same requests.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvstrata.testing.faults import flip_last_byte

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def kvstrata_metrics(llm: Any) -> dict[tuple[str, str], float]:
    """``{(name, tier or ""): value}`` of the vllm:kvstrata_* counters."""
    out: dict[tuple[str, str], float] = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:kvstrata_"):
            key = (metric.name.removesuffix("_total"), metric.labels.get("tier", ""))
            out[key] = out.get(key, 0.0) + float(metric.value)
    return out


def test_vllm_metrics_count_the_hits_loads_and_saves_the_connector_made(
    cached_llm: Any, live_sidecar: Any, counters: Any, reference: dict, kit: Any
) -> None:
    prompts = kit.WORKLOADS["metrics"]
    kit.reconnect(cached_llm, counters)  # an earlier test may have left the connector backing off
    before, vllm_before = counters.snapshot(), kvstrata_metrics(cached_llm)
    sources_before = cached_by_source(cached_llm)
    assert kit.generate(cached_llm, prompts) == reference["metrics"]  # cold: saves
    assert kit.generate(cached_llm, prompts) == reference["metrics"]  # warm: loads
    d = kit.delta(before, counters.snapshot())
    after = kvstrata_metrics(cached_llm)
    v = {k: after[k] - vllm_before.get(k, 0.0) for k in after}

    assert d["hit_tokens_l1"] > 0 and d["saved_chunks"] > 0, d
    assert v[("vllm:kvstrata_hit_tokens", "l1")] == d["hit_tokens_l1"]
    assert v[("vllm:kvstrata_loaded_chunks", "")] == d["loaded_chunks"]
    assert v[("vllm:kvstrata_saved_chunks", "")] == d["saved_chunks"]
    assert v[("vllm:kvstrata_load_failed_chunks", "")] == d["failed_chunks"] == 0
    assert v[("vllm:kvstrata_loaded_bytes", "")] > 0
    assert v[("vllm:kvstrata_lookups", "")] >= len(prompts)
    # vLLM's own hit-by-source counter: kvstrata's L1 hits are host-memory hits.
    by_source = cached_by_source(cached_llm)
    assert by_source.get("host", 0.0) - sources_before.get("host", 0.0) == d["hit_tokens_l1"]


def cached_by_source(llm: Any) -> dict[str, float]:
    """``vllm:prompt_tokens_cached_by_source`` by its ``source`` label."""
    out: dict[str, float] = {}
    for metric in llm.get_metrics():
        if metric.name.removesuffix("_total") == "vllm:prompt_tokens_cached_by_source":
            source = metric.labels.get("source", "")
            out[source] = out.get(source, 0.0) + float(metric.value)
    return out


def test_load_failures_reach_vllm_metrics_and_vllm_recomputes(
    cached_llm: Any, live_sidecar: Any, counters: Any, reference: dict, kit: Any
) -> None:
    """Chunks on disk corrupted behind the sidecar's back: lookups still find them
    (the index holds), their loads fail the checksum, vLLM recomputes those tokens
    and its metrics count the failed chunks."""
    prompts = kit.WORKLOADS["load_failure"]
    kit.reconnect(cached_llm, counters)
    assert kit.generate(cached_llm, prompts) == reference["load_failure"]  # stored
    live_sidecar.stop()  # SIGTERM: the write-behind into L2 is flushed
    files = sorted((live_sidecar.root / "l2").rglob("*.kvs"))
    assert files
    for path in files:
        flip_last_byte(path)
    live_sidecar.start()  # empty L1; L2 re-indexed from the (intact) headers
    kit.reconnect(cached_llm, counters)
    before, vllm_before = counters.snapshot(), kvstrata_metrics(cached_llm)
    assert kit.generate(cached_llm, prompts) == reference["load_failure"]
    d = kit.delta(before, counters.snapshot())
    v = kvstrata_metrics(cached_llm)
    failed = v[("vllm:kvstrata_load_failed_chunks", "")] - vllm_before.get(
        ("vllm:kvstrata_load_failed_chunks", ""), 0.0
    )
    assert d["failed_chunks"] > 0, d
    assert failed == d["failed_chunks"]
