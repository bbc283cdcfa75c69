"""``kvstrata bench serve``'s sealed regimes: the plain regime's sidecar with
encryption at rest required, and the sealed / plain throughput of the same series
(bench/serve.py ``_sidecar_overrides``, ``add_sealed_ratios``). The sidecar reads
the config the bench writes, so it is loaded here as the sidecar loads it."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvstrata.bench import serve
from kvstrata.sidecar.config import config_from_dict
from kvstrata.sidecar.sealing import KeyRing


@pytest.mark.parametrize("regime", ["l2", "valkey"])
def test_a_sealed_regime_is_its_plain_regime_with_encryption_required(
    regime: str, tmp_path: Path
) -> None:
    plan = serve.Plan()
    shared = {"backend": "valkey", "valkey": {"url": "redis://127.0.0.1:6379"}}
    keys = serve.publish_bench_key(tmp_path / "keys")
    plain = serve._sidecar_overrides(regime, plan, shared)
    l1, sealed = serve._sidecar_overrides(f"{regime}_sealed", plan, shared, keys)
    assert l1 == plain[0]
    assert {k: v for k, v in sealed.items() if k != "encryption"} == plain[1]
    config = config_from_dict(sealed)
    assert config.encryption.mode == "required"
    # The folder holds a key the sidecar's key ring opens and writes with.
    assert KeyRing(config.encryption.mode, config.encryption.key_dir).writing_key_id == "bench"


def test_a_sealed_regime_without_a_key_folder_is_refused() -> None:
    with pytest.raises(ValueError, match="l2_sealed: a sealed regime needs a key folder"):
        serve._sidecar_overrides("l2_sealed", serve.Plan(), None)


def test_sealed_regimes_are_asked_by_name_and_left_out_of_a_default_run() -> None:
    plan = serve.plan_from(argparse.Namespace(quick=False, param=["regimes=l2,l2_sealed"]))
    assert plan.regimes == "l2,l2_sealed"
    assert not [r for r in serve.Plan().regimes.split(",") if r.endswith("_sealed")]


def _regime(throughput: float, group: list[str], binding: str = "0", failed: int = 0) -> dict:
    return {
        "vllm_runs_shared_with": group,
        "failed_requests": {"kvstrata": failed},
        "kvstrata": {
            "request_throughput": {"median": throughput},
            "bindings": [{"omp": binding}],
        },
    }


def test_the_sealed_ratio_is_kvstratas_median_throughput_sealed_over_plain() -> None:
    group = ["l2", "l2_sealed", "valkey_sealed"]
    regimes = {"l2": _regime(1.60, group), "l2_sealed": _regime(1.52, group),
               "valkey_sealed": _regime(1.4, group)}  # fmt: skip
    serve.add_sealed_ratios(regimes)
    assert regimes["l2_sealed"]["sealed_vs_plain"] == pytest.approx(1.52 / 1.60)
    assert "sealed_vs_plain" not in regimes["valkey_sealed"]  # its plain regime did not run
    assert "sealed / plain throughput 0.950" in serve.format_table(
        {"regimes": {"l2_sealed": _table_row(regimes["l2_sealed"])}}
    )


@pytest.mark.parametrize(
    ("plain", "why"),
    [
        (_regime(1.6, ["l2"]), "not measured in the same series"),
        (_regime(1.6, ["l2", "l2_sealed"], binding="1"), "different CPU bindings"),
        (_regime(1.6, ["l2", "l2_sealed"], failed=2), "requests failed"),
    ],
)
def test_no_sealed_ratio_between_unequal_runs(plain: dict, why: str) -> None:
    regimes = {"l2": plain, "l2_sealed": _regime(1.5, ["l2", "l2_sealed"])}
    serve.add_sealed_ratios(regimes)
    assert "sealed_vs_plain" not in regimes["l2_sealed"]
    assert why in regimes["l2_sealed"]["sealed_vs_plain_refused"]


def _table_row(regime: dict) -> dict:
    """A regime as format_table reads it (the fields the sealed line does not use)."""
    figure = {"median": 1.0}
    ours = {f"ttft_{p}_s": figure for p in ("p50", "p90", "p99")}
    return {
        **regime,
        "ratio": None,
        "bindings_equal": True,
        "vllm": {"request_throughput": figure},
        "kvstrata": {**ours, **regime["kvstrata"], "hit_tokens": {}},
    }


def test_a_run_with_sealed_regimes_is_recorded_apart_from_the_serving_figures() -> None:
    assert serve.results_name(["l2", "l2_sealed"]) == "serve-sealed"
    assert serve.results_name(["l1", "l2", "valkey", "multi_turn", "new_replica"]) == "serve"
