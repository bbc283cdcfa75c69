"""``docs/configuration.md``: every key of the sidecar's config, from the fields of
:class:`kvstrata.sidecar.config.SidecarConfig` (type, default, bounds, description).

A default made by a factory is shown as the factory's
docstring's first paragraph up to its first ": " (e.g. ``default_endpoint``'s), so the text
lives beside the code that computes it.
"""

from __future__ import annotations

import inspect
import types
import typing
from enum import Enum
from typing import Any, Literal, Union

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from kvstrata.refdocs.markdown import GENERATED, table
from kvstrata.sidecar.config import ENV_NESTING, ENV_PREFIX, SidecarConfig, parse_quantity

_BOUNDS = (
    (annotated_types.Ge, "ge", ">="),
    (annotated_types.Gt, "gt", ">"),
    (annotated_types.Le, "le", "<="),
    (annotated_types.Lt, "lt", "<"),
)


def render() -> str:
    lines = [
        "# Sidecar configuration",
        "",
        GENERATED.format(source="the fields of `kvstrata.sidecar.config.SidecarConfig`"),
        "",
        "`kvstrata sidecar --config FILE` reads a YAML file of these keys (sections are",
        f"maps). Environment variables override the file: `{ENV_PREFIX}` + the dotted key",
        f"with `{ENV_NESTING}` for each dot, upper case (e.g. `{ENV_PREFIX}L1{ENV_NESTING}"
        "SIZE_BYTES=4Gi`). An unknown key is refused, naming it. Byte sizes take an",
        "integer or a Kubernetes quantity (`512Mi`, `4Gi`, `1G`). On Kubernetes the",
        "operator writes this file from the KVCache ([kvcache.md](kvcache.md)).",
        "",
    ]
    lines += _section(SidecarConfig, "", "Top level")
    return "\n".join(lines) + "\n"


def _section(model: type[BaseModel], prefix: str, title: str) -> list[str]:
    rows, subsections = [], []
    for name, info in model.model_fields.items():
        key = prefix + name
        sub = _submodel(info)
        if sub is not None:
            subsections.append((sub, key))
            continue
        item = _item_model(info)
        if item is not None:  # a list of sections: a row, then the item's own keys
            subsections.append((item, key + "[]"))
        rows.append((f"`{key}`", _type(info), _default(info), _description(info)))
    doc = inspect.cleandoc(model.__doc__ or "")
    out = [f"## {title}", ""]
    if doc:
        out += [doc, ""]
    out += [*table(("key", "type", "default", "meaning"), rows), ""]
    for sub, key in subsections:
        out += _section(sub, key + ".", f"`{key}`")
    return out


def _submodel(info: FieldInfo) -> type[BaseModel] | None:
    annotation = info.annotation
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def _item_model(info: FieldInfo) -> type[BaseModel] | None:
    """The item model of a field that is a list of sections (``tenants``)."""
    args = typing.get_args(info.annotation)
    if typing.get_origin(info.annotation) is list and args:
        item = args[0]
        if isinstance(item, type) and issubclass(item, BaseModel):
            return item
    return None


def _type(info: FieldInfo) -> str:
    text = _annotation(info.annotation, info.metadata)
    bounds = _bounds(info.metadata)
    return f"{text}, {bounds}" if bounds else text


def _annotation(annotation: Any, metadata: list[Any]) -> str:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return _annotation(args[0], list(args[1:]))
    if origin is Literal:
        return " | ".join(f"`{a}`" for a in args)
    if isinstance(annotation, type) and issubclass(annotation, Enum):
        # Written in a config as the members' values.
        return " | ".join(f"`{m.value}`" for m in annotation)
    if origin in (Union, types.UnionType):
        named = [a for a in args if a is not type(None)]
        text = " or ".join(_annotation(a, []) for a in named)
        return f"{text} or null" if len(named) < len(args) else text
    if origin is list:
        return f"list of {_annotation(args[0], [])}"
    if any(getattr(m, "func", None) is parse_quantity for m in metadata):
        return "bytes"
    for meta in metadata:
        if isinstance(meta, FieldInfo):  # Annotated[int, Field(ge=0)] inside a list
            inner = _annotation(annotation, meta.metadata)
            bounds = _bounds(meta.metadata)
            return f"{inner} {bounds}" if bounds else inner
    return getattr(annotation, "__name__", str(annotation))


def _bounds(metadata: list[Any]) -> str:
    parts = []
    for meta in metadata:
        for kind, attr, sign in _BOUNDS:
            if isinstance(meta, kind):
                parts.append(f"{sign} {getattr(meta, attr)}")
    return ", ".join(parts)


def _default(info: FieldInfo) -> str:
    if info.default_factory is list:
        return "`[]`"
    if info.default_factory is not None:
        doc = (info.default_factory.__doc__ or "").strip()
        # "``DEFAULT``: why ...": the text before the first ": " (an endpoint's
        # "://" is not a separator), double backticks made Markdown's single.
        first = " ".join(doc.split("\n\n")[0].split())
        head = first.split(": ")[0] if doc else "(computed)"
        return head.replace("``", "`")
    if info.default is PydanticUndefined:
        return "required"
    if info.default is None:
        return "unset"
    if isinstance(info.default, Enum):
        return f"`{info.default.value}`"
    return f"`{info.default}`"


def _description(info: FieldInfo) -> str:
    return info.description or ""
