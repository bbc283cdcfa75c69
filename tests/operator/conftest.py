"""Fixtures for the cluster-free operator suite.

* ``InMemoryCluster``: the :class:`kvstrata.operator.cluster.Cluster`
  protocol over a dict. Not a mock of behaviour under test: it is the stand-in
  for an API server on machines without one (the ``k8s`` suite runs the same
  code against a real one). ``apply`` keeps ``status`` and bumps
  ``resourceVersion`` only when the object changed, like server-side apply.
* Events: ``kopf.event`` is replaced for every test by the recorder in
  :mod:`events`; a test routes them to a list with ``record_events``.
* ``k8s_valid``: validates a rendered object against the Kubernetes JSON
  schemas shipped inside ``kubernetes-validate`` (strict: unknown fields fail).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest

from kvstrata.operator.kube import WriteConflict

REPO = Path(__file__).resolve().parents[2]
K8S_VERSION = "1.33"


def _deep_merge(base: dict[str, Any], patch: Mapping[str, Any]) -> dict[str, Any]:
    for key, value in patch.items():
        if value is None:
            base.pop(key, None)
        elif isinstance(value, Mapping) and isinstance(base.get(key), dict):
            _deep_merge(base[key], value)
        else:
            base[key] = copy.deepcopy(value)
    return base


class InMemoryCluster:
    def __init__(self, kinds: set[tuple[str, str]] | None = None) -> None:
        self.objects: dict[tuple[str, str, str, str], dict[str, Any]] = {}
        self.kinds = kinds or set()
        self.version = 0
        self.applied: list[dict[str, Any]] = []
        self.patches: list[tuple[str, str, dict[str, Any]]] = []

    def _key(self, api_version: str, kind: str, namespace: str, name: str):
        return (api_version, kind, namespace or "", name)

    def _bump(self, obj: dict[str, Any]) -> None:
        self.version += 1
        obj.setdefault("metadata", {})["resourceVersion"] = str(self.version)

    def put(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Store an object as if some other client created it."""
        stored = copy.deepcopy(dict(obj))
        meta = stored["metadata"]
        meta.setdefault("uid", f"uid-{meta['name']}")
        self._bump(stored)
        key = self._key(
            stored["apiVersion"], stored["kind"], meta.get("namespace", ""), meta["name"]
        )
        self.objects[key] = stored
        return stored

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict | None:
        found = self.objects.get(self._key(api_version, kind, namespace, name))
        return copy.deepcopy(found) if found is not None else None

    def apply(self, obj: Mapping[str, Any]) -> dict:
        self.applied.append(copy.deepcopy(dict(obj)))
        meta = obj["metadata"]
        key = self._key(obj["apiVersion"], obj["kind"], meta.get("namespace", ""), meta["name"])
        old = self.objects.get(key)
        new = copy.deepcopy(dict(obj))
        if old is not None:
            if "status" in old:
                new["status"] = old["status"]
            for field in ("uid", "resourceVersion"):
                new["metadata"][field] = old["metadata"].get(field)
            if new == old:
                return copy.deepcopy(old)
        else:
            new["metadata"]["uid"] = f"uid-{meta['name']}"
        self._bump(new)
        self.objects[key] = new
        return copy.deepcopy(new)

    # create and replace model the API server's rules for racing writers: a
    # create of an existing object and a replace at a stale resourceVersion are
    # refused with 409 (WriteConflict), so exactly one writer wins.
    def create(self, obj: Mapping[str, Any]) -> dict:
        meta = obj["metadata"]
        key = self._key(obj["apiVersion"], obj["kind"], meta.get("namespace", ""), meta["name"])
        if key in self.objects:
            raise WriteConflict(f"{obj['kind']} {meta['name']} already exists")
        self.applied.append(copy.deepcopy(dict(obj)))
        return self.put(obj)

    def replace(self, obj: Mapping[str, Any]) -> dict:
        meta = obj["metadata"]
        key = self._key(obj["apiVersion"], obj["kind"], meta.get("namespace", ""), meta["name"])
        old = self.objects.get(key)
        if old is None or old["metadata"].get("resourceVersion") != meta.get("resourceVersion"):
            raise WriteConflict(f"{obj['kind']} {meta['name']} changed since it was read")
        self.applied.append(copy.deepcopy(dict(obj)))
        new = copy.deepcopy(dict(obj))
        new["metadata"]["uid"] = old["metadata"].get("uid")
        self._bump(new)
        self.objects[key] = new
        return copy.deepcopy(new)

    def list(self, api_version: str, kind: str, namespace: str, label_selector: str | None = None):
        wanted = dict(p.split("=", 1) for p in label_selector.split(",")) if label_selector else {}
        out = []
        for (av, k, ns, _), obj in self.objects.items():
            labels = obj["metadata"].get("labels") or {}
            if (av, k, ns) == (api_version, kind, namespace) and all(
                labels.get(a) == b for a, b in wanted.items()
            ):
                out.append(copy.deepcopy(obj))
        return out

    def patch(self, api_version: str, kind: str, namespace: str, name: str, body):
        key = self._key(api_version, kind, namespace, name)
        self.patches.append((kind, name, copy.deepcopy(dict(body))))
        _deep_merge(self.objects[key], body)
        self._bump(self.objects[key])
        return copy.deepcopy(self.objects[key])

    def has_kind(self, api_version: str, kind: str) -> bool:
        return (api_version, kind) in self.kinds

    # What GET /version answers; a test sets another server's.
    version_info: dict[str, str] = {"major": "1", "minor": "33", "gitVersion": "v1.33.0"}

    def server_version(self) -> dict[str, str]:
        return dict(self.version_info)


@pytest.fixture
def cluster() -> InMemoryCluster:
    return InMemoryCluster()


@pytest.fixture(autouse=True)
def _events_recorded_not_posted(monkeypatch: pytest.MonkeyPatch) -> None:
    """``kopf.event`` replaced by the suite's recorder, which starts each test dropping Events."""
    import kopf

    from .events import EVENTS, record_events

    record_events(None)
    monkeypatch.setattr(kopf, "event", EVENTS)


def make_kvcache(name: str = "demo", namespace: str = "ml", **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "kvstrata.io/v1alpha1",
        "kind": "KVCache",
        "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}", "generation": 1},
        "spec": spec,
    }


def make_pod(
    annotations: dict[str, str] | None = None,
    containers: list[dict[str, Any]] | None = None,
    namespace: str = "ml",
    **spec: Any,
) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "vllm-0", "namespace": namespace, "annotations": annotations or {}},
        "spec": {
            "containers": containers
            if containers is not None
            else [
                {
                    "name": "vllm",
                    "image": "vllm/vllm-openai:latest",
                    "args": ["--model", "Qwen/Qwen2.5-0.5B"],
                }
            ],
            **spec,
        },
    }


@pytest.fixture(scope="session")
def k8s_valid() -> Callable[[Mapping[str, Any]], None]:
    import kubernetes_validate

    def check(obj: Mapping[str, Any]) -> None:
        kubernetes_validate.validate(dict(obj), K8S_VERSION, strict=True)

    return check


@pytest.fixture(name="make_kvcache")
def make_kvcache_fixture() -> Callable[..., dict[str, Any]]:
    return make_kvcache


@pytest.fixture(name="make_pod")
def make_pod_fixture() -> Callable[..., dict[str, Any]]:
    return make_pod
