"""Every generated reference page is what its source renders now: a changed
message field, config field description, extra-config key, CRD schema
description or chart ``@param`` without ``make docs`` fails here."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstrata.refdocs import PAGES, REPO
from kvstrata.refdocs import chart as chart_page


@pytest.mark.parametrize("page", sorted(PAGES))
def test_the_committed_page_is_rendered_from_its_source(page: str) -> None:
    committed = (REPO / page).read_text()
    assert committed == PAGES[page](REPO), f"{page} is stale: run `make docs`"


def test_every_chart_value_with_a_param_comment_is_listed() -> None:
    """The chart README lists each ``@param`` once, and each names a value."""
    text = (REPO / chart_page.VALUES).read_text()
    params = [p for _title, section in chart_page.parse(text) for p, _desc in section]
    lines = [line for line in text.splitlines() if line.lstrip().startswith("## @param ")]
    assert len(params) == len(set(params)) == len(lines)
    readme = (REPO / "charts/kvstrata/README.md").read_text()
    for param in params:
        assert f"| `{param}` |" in readme


def test_a_changed_description_makes_the_page_stale(tmp_path: Path) -> None:
    """The check compares against the source: one description edited in a copy
    of the CRD renders a different page."""
    (tmp_path / "crds").mkdir()
    crd = (REPO / "crds/kvcache.yaml").read_text()
    edited = crd.replace("Tokens per chunk;", "Tokens in each chunk;", 1)
    assert edited != crd
    (tmp_path / "crds/kvcache.yaml").write_text(edited)
    assert PAGES["docs/kvcache.md"](tmp_path) != (REPO / "docs/kvcache.md").read_text()


def test_every_sidecar_setting_has_a_description_for_the_configuration_page() -> None:
    from pydantic import BaseModel

    from kvstrata.sidecar.config import SidecarConfig

    def undescribed(model: type[BaseModel], prefix: str) -> list[str]:
        out = []
        for name, info in model.model_fields.items():
            sub = info.annotation
            if isinstance(sub, type) and issubclass(sub, BaseModel):
                out += undescribed(sub, f"{prefix}{name}.")
            elif not info.description:
                out.append(prefix + name)
        return out

    assert undescribed(SidecarConfig, "") == []


def test_every_protocol_field_has_a_meaning_for_the_protocol_page() -> None:
    """The page's meaning column is each field's comment in the message dataclass."""
    import dataclasses

    from kvstrata.refdocs.protocol import field_comments
    from kvstrata.sidecar import protocol

    bodies = {*protocol.REQUESTS.values(), *protocol.REPLIES.values(), protocol.ErrorReply}
    missing = [
        f"{cls.__name__}.{f.name}"
        for cls in bodies
        for f in dataclasses.fields(cls)
        if f.name != "op" and f.name not in field_comments(cls)
    ]
    assert sorted(missing) == []


def test_every_kvcache_field_has_a_description_for_the_kvcache_page() -> None:
    import yaml

    crd = yaml.safe_load((REPO / "crds/kvcache.yaml").read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]

    def undescribed(node: dict, path: str) -> list[str]:
        out = []
        for name, child in node.get("properties", {}).items():
            here = f"{path}.{name}"
            if not child.get("description"):
                out.append(here)
            out += undescribed(child, here)
            out += undescribed(child.get("items") or {}, here + "[]")
        return out

    assert undescribed(schema["properties"]["spec"], "spec") == []
    assert undescribed(schema["properties"]["status"], "status") == []
