"""``spec.tenants`` from the KVCache to the sidecar's config, through what the
API server admits and what the sidecar's loader accepts (plain functions, no
cluster)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from kvstrata.operator.model import SpecError
from kvstrata.operator.spec import render_sidecar_config

from .apiserver import admit, crd_schema

REPO = Path(__file__).resolve().parents[2]


def _schema() -> dict[str, Any]:
    return crd_schema(yaml.safe_load((REPO / "crds" / "kvcache.yaml").read_text()))


MANAGED = {"backend": "valkey", "valkey": {"managed": {}}}
S3 = {"backend": "s3", "s3": {"bucket": "kv-cache", "credentialsSecretRef": {"name": "s3-creds"}}}
SHARED_BUDGET = {"name": "a", "match": {"cacheSalts": ["a"]}, "budgets": {"shared": "1Gi"}}


def _kvcache(spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "kvstrata.io/v1alpha1",
        "kind": "KVCache",
        "metadata": {"name": "t", "namespace": "ml"},
        "spec": spec,
    }


def test_the_tenants_example_is_admitted_and_rendered_into_the_sidecars_tenants() -> None:
    example = yaml.safe_load((REPO / "examples" / "kvcache-tenants.yaml").read_text())
    stored, errors = admit(_schema(), example)
    assert errors == []
    config, text = render_sidecar_config(stored)
    team_a, team_b = config.tenants
    assert (team_a.name, team_a.ttl_seconds, team_a.pinned) == ("team-a", 86400, True)
    assert team_a.match.cache_salts == ["team-a"]
    assert team_a.budgets.l1_bytes == 20 << 30 and team_a.budgets.l2_bytes is None
    assert team_a.budgets.shared_bytes == 100 << 30  # kept by the Valkey server
    assert team_b.match.cache_salt_prefixes == ["team-b-"]
    assert (team_b.budgets.l1_bytes, team_b.budgets.l2_bytes, team_b.budgets.shared_bytes) == (
        0,
        0,
        0,
    )
    assert not team_b.memory_only and not team_b.keeps_in("l2")
    assert "team-b-" in text  # the ConfigMap body carries them


def test_a_kvcache_without_tenants_renders_none() -> None:
    config, _ = render_sidecar_config(_kvcache({}))
    assert config.tenants == []


@pytest.mark.parametrize(
    ("tenant", "named"),
    [
        ({"name": "a", "pinned": True, "match": {"cacheSalts": ["a"]}}, "needs budgets.l1_bytes"),
        ({"name": "a"}, "match needs cache_salts"),
        (
            {"name": "a", "match": {"models": ["m"]}, "budgets": {"shared": "1Gi"}},
            "a Valkey budget needs an expiry",
        ),
        ({"name": "default", "match": {"models": ["m"]}}, "tenants.0.name"),
    ],
)
def test_a_tenant_the_sidecar_would_refuse_is_a_spec_error_naming_it(
    tenant: dict[str, Any], named: str
) -> None:
    stored, errors = admit(_schema(), _kvcache({"shared": MANAGED, "tenants": [tenant]}))
    assert errors == []  # the API server lets these through; the render refuses them
    with pytest.raises(SpecError) as refused:
        render_sidecar_config(stored)
    assert named in str(refused.value)


@pytest.mark.parametrize(
    "tenant",
    [
        {"name": "Team A"},
        {"name": "a", "ttlSeconds": 0},
        {"name": "a", "budgets": {"l1": "lots"}},
        {"name": "a", "budgets": {"l1": "1" * 33}},
        {"name": "a", "budgets": {"l2": "1" * 33}},
        {"name": "a", "match": {"cacheSalts": [""]}},
    ],
)
def test_the_api_server_refuses_a_malformed_tenant(tenant: dict[str, Any]) -> None:
    _, errors = admit(_schema(), _kvcache({"tenants": [tenant]}))
    assert errors, tenant


def test_two_tenants_of_one_name_are_a_spec_error() -> None:
    one = {"name": "a", "match": {"cacheSalts": ["a"]}}
    with pytest.raises(SpecError, match="tenant name 'a' is used twice"):
        render_sidecar_config(_kvcache({"tenants": [one, one]}))


@pytest.mark.parametrize("budget", ["1Gi", 5, "0.5Gi", "10", "00"])
def test_the_api_server_refuses_a_shared_budget_on_s3_naming_valkey(budget: str | int) -> None:
    tenant = {**SHARED_BUDGET, "budgets": {"shared": budget}}
    _, errors = admit(_schema(), _kvcache({"shared": S3, "tenants": [tenant]}))
    assert errors == [
        "spec: tenants[].budgets.shared must be 0 or unset when shared.backend is s3: S3 "
        "cannot enforce a byte budget (shared.backend valkey does)"
    ]


@pytest.mark.parametrize("budget", ["0", 0, "0Gi", "0k", "0Pi"])
def test_the_api_server_admits_a_shared_budget_of_0_on_s3(budget: str | int) -> None:
    tenant = {**SHARED_BUDGET, "budgets": {"shared": budget}}
    stored, errors = admit(_schema(), _kvcache({"shared": S3, "tenants": [tenant]}))
    assert errors == []
    config, _ = render_sidecar_config(stored)
    assert config.tenants[0].budgets.shared_bytes == 0


def test_a_shared_budget_on_s3_that_reaches_the_render_is_a_spec_error_naming_valkey() -> None:
    # An object stored before the CRD had its rule (the API server checks new writes only).
    with pytest.raises(SpecError) as refused:
        render_sidecar_config(_kvcache({"shared": S3, "tenants": [SHARED_BUDGET]}))
    message = str(refused.value)
    assert "tenants.0.budgets.shared_bytes ('a'): shared.backend s3 cannot enforce" in message
    assert "shared.backend valkey, which enforces it" in message


@pytest.mark.parametrize(
    ("shared", "tenant"),
    [
        ({**MANAGED, "valkey": {"managed": {}, "ttlSeconds": 3600}}, SHARED_BUDGET),
        (MANAGED, {**SHARED_BUDGET, "ttlSeconds": 600}),
    ],
)
def test_a_shared_budget_on_valkey_with_an_expiry_is_rendered_for_the_sidecar(
    shared: dict[str, Any], tenant: dict[str, Any]
) -> None:
    stored, errors = admit(_schema(), _kvcache({"shared": shared, "tenants": [tenant]}))
    assert errors == []
    config, text = render_sidecar_config(stored)
    assert config.tenants[0].budgets.shared_bytes == 1 << 30
    assert f"shared_bytes: {1 << 30}" in text
