"""``docs/kvcache.md``: the fields of the ``KVCache`` custom resource, from the
descriptions in its CRD's OpenAPI schema (``crds/kvcache.yaml``, the one
source); and the chart's copy of that CRD (``charts/kvstrata/crds/``), which
is the same file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from kvstrata.refdocs.markdown import GENERATED, table

CRD = "crds/kvcache.yaml"


def chart_copy(repo: Path) -> str:
    """The chart ships the CRD unchanged (Helm installs ``crds/`` as they are)."""
    return (repo / CRD).read_text()


def render(repo: Path) -> str:
    crd = yaml.safe_load((repo / CRD).read_text())
    names = crd["spec"]["names"]
    group = crd["spec"]["group"]
    (version,) = crd["spec"]["versions"]
    schema = version["schema"]["openAPIV3Schema"]
    lines = [
        f"# {names['kind']}",
        "",
        GENERATED.format(source=f"the schema descriptions of `{CRD}`"),
        "",
        f"`{names['kind']}` (`{group}/{version['name']}`), full resource name "
        f"`{crd['metadata']['name']}`. " + " ".join(schema.get("description", "").split()),
        "",
        f"`kubectl get {names['plural']}.{group}` names it unambiguously beside other "
        f"`{names['kind']}` kinds (AIBrix's is `kvcaches.orchestration.aibrix.ai`); "
        f"short name{'s' if len(names.get('shortNames', [])) > 1 else ''} "
        + ", ".join(f"`{s}`" for s in names.get("shortNames", []))
        + "; categor"
        + ("ies " if len(names.get("categories", [])) > 1 else "y ")
        + ", ".join(f"`{c}`" for c in names.get("categories", []))
        + f" (`kubectl get {names.get('categories', ['all'])[0]}`).",
        "",
    ]
    for part in ("spec", "status"):
        node = schema["properties"][part]
        lines += [f"## `{part}`", "", " ".join(node.get("description", "").split()), ""]
        lines += table(("field", "type", "default", "meaning"), list(_rows(node, part)))
        lines.append("")
    return "\n".join(lines).rstrip("\n") + "\n"


def _rows(node: dict[str, Any], path: str) -> Any:
    for name, child in node.get("properties", {}).items():
        here = f"{path}.{name}"
        yield (f"`{here}`", _type(child), _default(child), " ".join(_description(child).split()))
        yield from _rows(child, here)
        items = child.get("items")
        if isinstance(items, dict) and items.get("properties"):
            yield from _rows(items, here + "[]")


def _type(node: dict[str, Any]) -> str:
    if node.get("x-kubernetes-int-or-string"):
        return "quantity"
    kind = node.get("type", "")
    if "enum" in node:
        return " | ".join(f"`{v}`" if v != "" else '`""`' for v in node["enum"])
    if kind == "array":
        return f"list of {_type(node.get('items', {}))}"
    return kind


def _default(node: dict[str, Any]) -> str:
    if "default" not in node:
        return ""
    value = node["default"]
    return "" if value == {} else f"`{value}`"


def _description(node: dict[str, Any]) -> str:
    return str(node.get("description", ""))
