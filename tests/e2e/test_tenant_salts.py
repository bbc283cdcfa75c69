"""vLLM's own requests, salted per tenant, through the connector into a
sidecar with tenants: each salt's chunks are kept by its tenant's rules, and
outputs with the hits equal those without."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvstrata.testing.localstack import release_held_engine, shutdown_engine, transfer_config

TENANTS = [
    {"name": "team-a", "match": {"cache_salts": ["team-a"]}, "memory_only": True},
    {"name": "team-b", "match": {"cache_salt_prefixes": ["team-b-"]}, "budgets": {"l1_bytes": 0}},
]


def test_requests_salted_for_a_tenant_are_kept_by_its_rules(
    vllm_env: None, tiny_model: Path, kit: Any, tmp_path: Path
) -> None:
    from vllm import LLM, SamplingParams

    sidecar = kit.SidecarProcess(tmp_path / "sidecar", overrides={"tenants": TENANTS})
    sidecar.start()
    release_held_engine()  # another test's engine in this process
    transfer = transfer_config(
        sidecar.endpoint, kit.CHUNK, call_timeout_seconds=2.0, load_timeout_seconds=10.0
    )
    llm = LLM(**kit.engine_args(tiny_model), kv_transfer_config=transfer)
    try:
        salts = ["team-a", "team-b-7", None]
        prompts = [
            {"prompt_token_ids": kit.tokens(3 * kit.CHUNK + 5, 900 + i)}
            | ({"cache_salt": salt} if salt else {})
            for i, salt in enumerate(salts)
        ]
        params = SamplingParams(temperature=0.0, max_tokens=kit.MAX_TOKENS, ignore_eos=True)
        first = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
        held = {
            t: sidecar.metric("kvstrata_tenant_bytes", 0.0, tenant=t, tier="l1")
            for t in ("team-a", "team-b", "default")
        }
        assert held["team-a"] > 0 and held["default"] > 0
        assert held["team-b"] == 0  # a budget of 0: never kept
        refused = {"reason": "not_kept", "tenant": "team-b", "tier": "l1"}
        assert sidecar.metric("kvstrata_tenant_refusals_total", 0.0, **refused) > 0
        assert sidecar.metric("kvstrata_errors_total", 0.0, kind="unknown_tenant") == 0

        hits_before = sidecar.metric("kvstrata_hit_tokens_total", 0.0, tier="l1")
        again = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
        assert again == first
        # team-a's and the default prompt's chunks hit; team-b's cannot.
        hit = sidecar.metric("kvstrata_hit_tokens_total", 0.0, tier="l1") - hits_before
        assert hit == 2 * 3 * kit.CHUNK
    finally:
        shutdown_engine(llm)
        sidecar.cleanup()
