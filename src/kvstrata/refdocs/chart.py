"""``charts/kvstrata/README.md``: the chart's parameters, from the
``## @param dotted.path Description`` comments of its ``values.yaml`` (a
description may continue on the following ``##`` lines) and the default
values beside them; ``## @section`` lines start a table."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from kvstrata.refdocs.markdown import GENERATED, table

VALUES = "charts/kvstrata/values.yaml"
_PARAM = re.compile(r"^\s*## @param (\S+)\s*(.*)$")
_SECTION = re.compile(r"^\s*## @section\s+(.*)$")
_MORE = re.compile(r"^\s*## (?!@)(.*)$")


def render(repo: Path) -> str:
    chart = yaml.safe_load((repo / "charts/kvstrata/Chart.yaml").read_text())
    text = (repo / VALUES).read_text()
    values = yaml.safe_load(text)
    lines = [
        f"# The `{chart['name']}` Helm chart",
        "",
        GENERATED.format(source="the `@param` comments of `values.yaml`"),
        "",
        f"{chart['description']}. Chart {chart['version']}, app {chart['appVersion']}, "
        f"Kubernetes `{chart['kubeVersion']}`. Installing, checking and troubleshooting: "
        "the project's README; the `KVCache` fields: `docs/kvcache.md`.",
        "",
        "```sh",
        f"helm install {chart['name']} charts/{chart['name']} -n kvstrata-system "
        "--create-namespace",
        "```",
        "",
    ]
    for title, params in parse(text):
        lines += [f"## {title}", ""]
        rows = [(f"`{p}`", desc, _value(values, p)) for p, desc in params]
        lines += [*table(("parameter", "description", "default"), rows), ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def parse(text: str) -> list[tuple[str, list[tuple[str, str]]]]:
    """``[(section title, [(dotted path, description)])]`` in file order."""
    sections: list[tuple[str, list[tuple[str, str]]]] = [("Parameters", [])]
    current: list[str] | None = None  # the description being read
    for line in text.splitlines():
        section, param = _SECTION.match(line), _PARAM.match(line)
        if section:
            sections.append((section.group(1).strip(), []))
            current = None
        elif param:
            sections[-1][1].append((param.group(1), param.group(2)))
            current = [param.group(2)]
        elif current is not None and (more := _MORE.match(line)):
            current.append(more.group(1))
            path, _ = sections[-1][1][-1]
            sections[-1][1][-1] = (path, " ".join(current))
        else:
            current = None
    return [(title, params) for title, params in sections if params]


def _value(values: dict[str, Any], path: str) -> str:
    node: Any = values
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            raise KeyError(f"{VALUES}: @param {path} names no value")
        node = node[part]
    return f"`{json.dumps(node)}`"
