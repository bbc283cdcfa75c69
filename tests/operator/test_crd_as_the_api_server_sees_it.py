"""The KVCache CRD through what kube-apiserver checks at CRD creation and at admission.

The checks are modelled in :mod:`apiserver` (this directory), which names
its sources; the ``k8s`` suite applies the CRD to a real API server. Each
model check is also shown refusing a broken CRD, so a check that silently
passes everything would fail here.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from .apiserver import (
    PER_CRD_COST_LIMIT,
    PER_RULE_COST_LIMIT,
    admit,
    crd_schema,
    default_errors,
    estimated_cost,
    iter_defaults,
    rules,
    static_errors,
    structural_errors,
)

REPO = Path(__file__).resolve().parents[2]
CRD_PATH = REPO / "crds" / "kvcache.yaml"
# The Kubernetes versions the README promises (from the native-sidecar floor,
# operator/serverversion.py); kubernetes-validate ships each one's schemas.
SUPPORTED_VERSIONS = tuple(f"1.{minor}" for minor in range(29, 38))


def crd() -> dict[str, Any]:
    return yaml.safe_load(CRD_PATH.read_text())


def schema() -> dict[str, Any]:
    return crd_schema(crd())


def kvcache(spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "kvstrata.io/v1alpha1",
        "kind": "KVCache",
        "metadata": {"name": "demo", "namespace": "ml"},
        "spec": spec,
    }


def examples() -> list[tuple[str, dict[str, Any]]]:
    found = []
    for path in sorted((REPO / "examples").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "KVCache":
                found.append((path.name, doc))
    return found


# -- the CRD as it is ------------------------------------------------------------


@pytest.mark.parametrize("version", SUPPORTED_VERSIONS)
def test_the_crd_object_is_valid_on_every_supported_kubernetes_version(version):
    # Strict: a field the version's CustomResourceDefinition API lacks (say
    # optionalOldSelf before 1.29) fails here.
    kubernetes_validate.validate(crd(), version, strict=True)


def test_the_crd_schema_is_structural():
    assert structural_errors(schema()) == []


@pytest.mark.parametrize("site", list(iter_defaults(schema())), ids=lambda s: s.path)
def test_each_default_passes_what_crd_creation_checks(site):
    # A schema holding just this node, so each default is reported on its own.
    assert default_errors({"type": "object", "properties": {"x": site.node}}) == []


def test_every_cel_rule_compiles_to_declared_fields_and_standard_functions():
    found = rules(schema())
    assert {r.site.path for r in found} == {
        "spec",
        "spec.l2.volume",
        "spec.shared",
        "spec.shared.valkey",
    }
    for rule in found:
        assert static_errors(rule) == []


def test_every_cel_rule_stays_within_the_api_servers_cost_limits():
    costs = [estimated_cost(rule) for rule in rules(schema())]
    assert all(cost <= PER_RULE_COST_LIMIT for cost in costs), costs
    assert sum(costs) <= PER_CRD_COST_LIMIT


def test_an_empty_spec_is_admitted_and_stored_with_every_nested_default():
    stored, errors = admit(schema(), kvcache({}))
    assert errors == []
    spec = stored["spec"]
    assert spec["l2"]["volume"] == {"type": "emptyDir"}
    assert spec["shared"] == {"backend": "none", "codec": "none", "admission": "all"}
    assert spec["l1"] == {"size": "1Gi", "policy": "lru"}


@pytest.mark.parametrize(("name", "doc"), examples(), ids=lambda v: v if isinstance(v, str) else "")
def test_each_example_kvcache_is_admitted_unchanged_but_for_defaults(name, doc):
    stored, errors = admit(schema(), doc)
    assert errors == []

    def declared(given: Any, kept: Any) -> None:  # nothing the user wrote was pruned
        if isinstance(given, dict):
            for key, value in given.items():
                assert key in kept, f"{name}: {key} would be pruned"
                declared(value, kept[key])
        elif isinstance(given, list):  # items of a list of objects get defaults too
            assert isinstance(kept, list) and len(kept) == len(given)
            for item, kept_item in zip(given, kept, strict=True):
                declared(item, kept_item)
        else:
            assert given == kept

    declared(doc["spec"], stored["spec"])


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            {"l2": {"volume": {"type": "existingClaim"}}},
            "spec.l2.volume: l2.volume.claimName is required when l2.volume.type is existingClaim",
        ),
        (
            {"shared": {"backend": "s3"}},
            "spec.shared: shared.s3 is required when shared.backend is s3",
        ),
        (
            {"shared": {"valkey": {"managed": {}, "external": {"url": "redis://v:6379"}}}},
            "spec.shared.valkey: set one of shared.valkey.managed and shared.valkey.external",
        ),
    ],
)
def test_the_cel_rules_refuse_what_their_messages_say(spec, message):
    _, errors = admit(schema(), kvcache(spec))
    assert errors == [message]


@pytest.mark.parametrize(
    "spec",
    [
        {"l2": {"volume": {"type": "existingClaim", "claimName": "cache"}}},
        {"shared": {"backend": "s3", "s3": {"bucket": "kv-cache"}}},
        {"l2": {"volume": {"type": "ephemeral", "storageClassName": "fast"}}},
    ],
)
def test_the_cel_rules_admit_the_complete_forms(spec):
    assert admit(schema(), kvcache(spec))[1] == []


# -- the model refuses what the API server refuses --------------------------------


def test_rules_without_has_guards_fail_on_their_raw_defaults_as_the_api_server_said():
    # The rules as first written; the API server refused that CRD with
    # "no such key: type evaluating rule: l2.volume.claimName is required ...".
    unguarded = _broken(
        ["spec", "l2", "volume"],
        {"x-kubernetes-validations": [{"rule": VOLUME_RULE, "message": VOLUME_MESSAGE}]},
    )
    shared = unguarded["properties"]["spec"]["properties"]["shared"]
    shared["x-kubernetes-validations"] = [{"rule": SHARED_RULE, "message": SHARED_MESSAGE}]
    errors = default_errors(unguarded)
    assert len(errors) == 2
    volume, shared = sorted(errors)
    assert volume.startswith("spec.l2.volume.default: no such member")
    assert "'type'" in volume and "l2.volume.claimName is required" in volume
    assert shared.startswith("spec.shared.default: no such member") and "'backend'" in shared


def test_a_default_that_does_not_match_its_own_schema_or_carries_unknown_fields_is_refused():
    node = {
        "type": "object",
        "default": {"mode": "fast"},
        "properties": {"mode": {"type": "string", "enum": ["slow"]}},
    }
    assert default_errors({"type": "object", "properties": {"x": node}}) == [
        "x.default: mode: 'fast' is not one of ['slow']"
    ]
    node["default"] = {"other": 1}
    assert default_errors({"type": "object", "properties": {"x": node}}) == [
        "x.default: must not have unknown fields"
    ]


VOLUME_RULE = "self.type != 'existingClaim' || has(self.claimName)"
VOLUME_MESSAGE = "l2.volume.claimName is required when l2.volume.type is existingClaim"
SHARED_RULE = "self.backend != 's3' || has(self.s3)"
SHARED_MESSAGE = "shared.s3 is required when shared.backend is s3"


def _broken(path: list[str], change: dict[str, Any]) -> dict[str, Any]:
    """The CRD's schema with one node changed (a None value removes that keyword)."""
    broken = copy.deepcopy(schema())
    node = broken
    for name in path:
        node = node["properties"][name]
    for key, value in change.items():
        if value is None:
            node.pop(key, None)
        else:
            node[key] = value
    return broken


@pytest.mark.parametrize(
    ("path", "change", "expected"),
    [
        (["spec", "chunkSize"], {"type": None}, "type must not be empty"),
        (
            ["spec", "metrics"],
            {"additionalProperties": {"type": "string"}},
            "mutually exclusive",
        ),
        (["spec", "sidecar", "env"], {"uniqueItems": True}, "uniqueItems"),
        (["metadata"], {"properties": {"labels": {"type": "object"}}}, "name and generateName"),
        (["spec", "l1"], {"x-kubernetes-preserve-unknown-fields": False}, "true or undefined"),
        (["spec", "transferMode"], {"pattern": "(?<=a)b"}, "RE2"),
        (
            ["status", "conditions"],
            {"x-kubernetes-list-map-keys": ["reason"]},
            "required or defaulted",
        ),
    ],
)
def test_the_structural_check_refuses_what_crd_creation_refuses(path, change, expected):
    found = " ".join(structural_errors(_broken(path, change)))
    assert expected in found


def test_a_rule_naming_an_undeclared_field_or_an_unknown_function_is_refused():
    broken = _broken(
        ["spec", "l2", "volume"],
        {"x-kubernetes-validations": [{"rule": "self.clamName.isQuantity()"}]},
    )
    (rule,) = [r for r in rules(broken) if r.site.path == "spec.l2.volume"]
    errors = " ".join(static_errors(rule))
    assert "undefined field 'clamName'" in errors
    assert "isQuantity" in errors


def test_a_rule_iterating_unbounded_lists_exceeds_the_cost_limit_until_they_are_bounded():
    names: dict[str, Any] = {
        "type": "array",
        "items": {"type": "string"},
        "x-kubernetes-validations": [{"rule": "self.all(a, self.exists(b, a.startsWith(b)))"}],
    }
    unbounded = {"type": "object", "properties": {"names": names}}
    (rule,) = rules(unbounded)
    assert estimated_cost(rule) > PER_RULE_COST_LIMIT
    names.update(maxItems=16)
    names["items"]["maxLength"] = 63
    (rule,) = rules(unbounded)
    assert estimated_cost(rule) <= PER_RULE_COST_LIMIT


def test_an_int_or_string_is_sized_by_the_request_limit_whatever_its_max_length():
    """Kubernetes 1.29 does not read an int-or-string's maxLength when it
    estimates a rule's cost (its real API server refused a pattern over one):
    a pattern over the value is too costly, comparing it with literals is not."""

    def listed(rule: str) -> dict[str, Any]:
        quantity = {"x-kubernetes-int-or-string": True, "maxLength": 32}
        item = {"type": "object", "properties": {"q": quantity}}
        return {
            "type": "object",
            "properties": {"many": {"type": "array", "maxItems": 64, "items": item}},
            "x-kubernetes-validations": [{"rule": rule}],
        }

    (pattern,) = rules(listed("self.many.all(t, type(t.q) == string && t.q.matches('^0+$'))"))
    assert estimated_cost(pattern) > PER_RULE_COST_LIMIT
    (compared,) = rules(listed("self.many.all(t, t.q == 0 || t.q in ['0', '0Gi'])"))
    assert estimated_cost(compared) <= PER_RULE_COST_LIMIT


def test_a_rule_inside_a_list_counts_once_per_possible_item():
    item = {
        "type": "object",
        "properties": {"a": {"type": "string", "maxLength": 8}},
        "x-kubernetes-validations": [{"rule": "self.a != 'x'"}],
    }
    single = {"type": "object", "properties": {"one": item}}
    listed = {
        "type": "object",
        "properties": {"many": {"type": "array", "maxItems": 50, "items": item}},
    }
    (alone,), (each,) = rules(single), rules(listed)
    assert estimated_cost(each) == 50 * estimated_cost(alone)


def test_oldself_inside_an_atomic_list_is_refused():
    item = {
        "type": "object",
        "properties": {"a": {"type": "string"}},
        "x-kubernetes-validations": [{"rule": "self.a == oldSelf.a", "message": "immutable"}],
    }
    atomic = {"type": "object", "properties": {"l": {"type": "array", "items": item}}}
    (rule,) = rules(atomic)
    assert any("oldSelf" in e for e in static_errors(rule))
    keyed = copy.deepcopy(atomic)
    keyed["properties"]["l"].update(
        {"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["a"]}
    )
    keyed["properties"]["l"]["items"]["required"] = ["a"]
    (rule,) = rules(keyed)
    assert static_errors(rule) == []


def test_the_readme_version_statement_is_a_plain_range():
    readme = (REPO / "README.md").read_text()
    stated = re.findall(r"Kubernetes (1\.\d+) through (1\.\d+)", readme)
    assert stated == [(SUPPORTED_VERSIONS[0], SUPPORTED_VERSIONS[-1])]
