"""The typed KVCache models against the CRD: same fields, same defaults, at every level.

The CRD (``crds/kvcache.yaml``) is what the API server defaults a stored
KVCache with; the models are what the operator reads a KVCache as. A default
changed in one and not the other fails here.
"""

from __future__ import annotations

import copy
import types
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from kvstrata.operator import spec as S
from kvstrata.operator.model import KVCache, KVCacheSpec

from .apiserver import admit, apply_defaults, crd_schema

REPO = Path(__file__).resolve().parents[2]
CRD_PATH = REPO / "crds" / "kvcache.yaml"


def spec_schema() -> dict[str, Any]:
    return crd_schema(yaml.safe_load(CRD_PATH.read_text()))["properties"]["spec"]


def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The model class inside ``Model`` or ``Model | None``; None for other types."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        found = [m for m in map(_model_of, typing.get_args(annotation)) if m is not None]
        return found[0] if found else None
    return None


def drift(model: type[BaseModel], node: dict[str, Any], path: str = "spec") -> list[str]:
    """Where ``model`` and the schema ``node`` disagree on fields or defaults, recursively.

    The defaults are compared as the API server applies them: what it fills
    into an empty object must be what the model's all-default instance holds.
    """
    errors: list[str] = []
    props = node.get("properties") or {}
    fields = {f.alias or name: f for name, f in model.model_fields.items()}
    if set(fields) != set(props):
        errors.append(f"{path}: fields {sorted(fields)} != CRD properties {sorted(props)}")
    filled = apply_defaults({}, node)
    made = model().model_dump(by_alias=True, exclude_none=True)
    if made != filled:
        errors.append(f"{path}: model defaults {made} != CRD defaults {filled}")
    for key in sorted(set(fields) & set(props)):
        child = _model_of(fields[key].annotation)
        if child is not None:
            errors += drift(child, props[key], f"{path}.{key}")
        elif props[key].get("type") == "object" and "properties" in props[key]:
            errors.append(f"{path}.{key}: an object in the CRD, not a model here")
    return errors


def test_model_fields_and_defaults_match_the_crd_at_every_level():
    assert drift(KVCacheSpec, spec_schema()) == []


@pytest.mark.parametrize(
    ("where", "change"),
    [
        ("l1.size", lambda s: s["properties"]["l1"]["properties"]["size"].update(default="2Gi")),
        (
            "shared.s3.region",
            lambda s: s["properties"]["shared"]["properties"]["s3"]["properties"]["region"].update(
                default="eu-west-1"
            ),
        ),
        (
            "metrics.serviceMonitor",
            lambda s: s["properties"]["metrics"]["properties"]["serviceMonitor"].update(default={}),
        ),
        ("chunkSize", lambda s: s["properties"]["chunkSize"].pop("default")),
        ("extra field", lambda s: s["properties"].update(extra={"type": "string"})),
    ],
)
def test_the_check_catches_a_default_changed_in_the_crd_only(where, change):
    schema = copy.deepcopy(spec_schema())
    change(schema)
    assert drift(KVCacheSpec, schema) != [], where


def test_a_kvcache_as_the_api_server_stores_it_reads_like_the_bare_spec():
    obj = {
        "apiVersion": S.API_VERSION,
        "kind": S.KIND,
        "metadata": {"name": "demo", "namespace": "ml"},
        "spec": {"shared": {"backend": "valkey", "valkey": {"managed": {}}}},
    }
    stored, errors = admit(crd_schema(yaml.safe_load(CRD_PATH.read_text())), obj)
    assert errors == []
    assert KVCache.parse(stored).spec == KVCache.parse(obj).spec


def test_unknown_fields_and_nulls_are_tolerated_and_wrong_types_name_the_field():
    parsed = KVCache.parse({"metadata": {"name": "a"}, "spec": {"future": 1, "l1": None}})
    assert parsed.spec.l1.size == "1Gi" and parsed.namespace == "default"
    assert parsed.raw_spec == {"future": 1, "l1": None}  # the config hash sees it as written
    with pytest.raises(S.SpecError, match=r"spec\.metrics\.port"):
        KVCache.parse({"metadata": {"name": "a"}, "spec": {"metrics": {"port": "http"}}})
