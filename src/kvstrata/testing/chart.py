"""The Helm chart rendered and created on an API server object by object, as ``helm
install`` does, for the k8s suite.

Why this module exists: helm-python-sdk renders but does not install, and two
tests install the chart (one checks that the API server accepts every object,
one runs the operator it deploys on the suite's node). :func:`install_into` creates
the chart's CRDs (``crds/``, which Helm applies before the templates) and then
the rendered templates in file order; :class:`Release.uninstall` deletes the
templates' objects newest first, as ``helm uninstall`` does, and leaves the
CRDs (Helm never deletes them either).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

CHART = Path(__file__).resolve().parents[3] / "charts" / "kvstrata"


def render(release: str, namespace: str, values: dict[str, Any]) -> list[dict[str, Any]]:
    """Every object ``helm template`` gives for these values, in file order."""
    import helm_python as helm

    manifests = helm.Chart.load(CHART).render(values=values, name=release, namespace=namespace)
    docs = []
    for path, text in sorted(manifests.items()):
        if path.endswith(".yaml"):  # NOTES.txt is text for the user
            docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def crds() -> list[dict[str, Any]]:
    """The CustomResourceDefinitions the chart ships in ``crds/``."""
    docs = []
    for path in sorted((CHART / "crds").glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


@dataclass
class Release:
    """What :func:`install_into` created, for :meth:`uninstall`."""

    client: Any  # kubernetes.dynamic.DynamicClient
    made: list[tuple[Any, dict[str, Any]]] = field(default_factory=list)

    def create(self, doc: dict[str, Any]) -> Any:
        resource = self.client.resources.get(api_version=doc["apiVersion"], kind=doc["kind"])
        target = doc["metadata"].get("namespace") if resource.namespaced else None
        created = resource.create(body=doc, namespace=target)
        self.made.append((resource, doc))
        return created

    def uninstall(self) -> None:
        from kubernetes.dynamic.exceptions import NotFoundError

        for resource, doc in reversed(self.made):
            target = doc["metadata"].get("namespace") if resource.namespaced else None
            # NotFound: its namespace's deletion took it already.
            with contextlib.suppress(NotFoundError):
                resource.delete(name=doc["metadata"]["name"], namespace=target)
        self.made.clear()


def install_into(release: Release, docs: list[dict[str, Any]]) -> None:
    """Create the chart's CRDs (when absent) and ``docs`` into ``release``, in order."""
    from kubernetes.dynamic.exceptions import NotFoundError

    definitions = release.client.resources.get(
        api_version="apiextensions.k8s.io/v1", kind="CustomResourceDefinition"
    )
    for crd in crds():
        try:
            definitions.get(name=crd["metadata"]["name"])
        except NotFoundError:
            definitions.create(body=crd)  # not recorded: Helm leaves CRDs behind too
    for doc in docs:
        release.create(doc)


def _dynamic(api: Any) -> Any:
    from kubernetes import dynamic

    return dynamic.DynamicClient(api)


def new_release(api: Any) -> Release:
    """An empty release on ``api``, to :func:`install_into` and uninstall in a ``finally``."""
    return Release(_dynamic(api))
