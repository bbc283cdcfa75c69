"""``docs/protocol.md``: the sidecar protocol, from the code that speaks it.

Sources: the prose is :mod:`kvstrata.sidecar.protocol`'s module docstring; the
ops are its ``REQUESTS`` / ``REPLIES`` tables; each body's fields (name, type,
default, and the comment on the field's line or the lines just above it) are
the dataclasses of :mod:`kvstrata.sidecar.messages`,
:mod:`kvstrata.sidecar.hello_messages`, :mod:`kvstrata.sidecar.event_messages`
and :mod:`kvstrata.sidecar.ipc_messages`; error codes and limits are the constants
of :mod:`kvstrata.sidecar.wire` with their comments.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from enum import Enum
from typing import Any

from kvstrata.refdocs.markdown import GENERATED, table
from kvstrata.sidecar import protocol, wire

_FIELD = re.compile(r"^\s+(\w+):[^#]*?(?:#\s*(.*))?$")
_COMMENT = re.compile(r"^\s+#\s?(.*)$")
_CONSTANT = re.compile(r"^([A-Z][A-Z_]*) = ([^#]+?)\s*(?:#\s*(.*))?$")


def render() -> str:
    lines = [
        "# Sidecar protocol",
        "",
        GENERATED.format(
            source="`kvstrata.sidecar.protocol` and the message dataclasses of "
            "`kvstrata.sidecar.messages` / `hello_messages` / `event_messages` / "
            "`ipc_messages`"
        ),
        "",
        inspect.getdoc(protocol) or "",
        "",
        "## Ops",
        "",
        f"Ops a client may send without a session: "
        f"{', '.join(sorted(protocol.SESSIONLESS_OPS))}. Every other op needs the",
        "`session_id` HELLO returned.",
        "",
    ]
    for op, request in protocol.REQUESTS.items():
        reply = protocol.REPLIES[op]
        lines += [f"### {op}", ""]
        lines += _body("Request", request)
        lines += _body("Reply", reply)
    lines += ["## Error replies", ""]
    lines += _body("Body", protocol.ErrorReply)
    lines += [
        *table(("code", "meaning"), [(f"`{v}`", c) for _n, v, c in _constants("E_")]),
        "",
        "## Limits",
        "",
        *table(
            ("constant", "value", "meaning"),
            [(f"`{n}`", v, c) for n, v, c in _constants("MAX_", "KEY_", "PROTOCOL_")],
        ),
    ]
    return "\n".join(lines) + "\n"


def _body(title: str, cls: type[Any]) -> list[str]:
    doc = inspect.getdoc(cls) if cls.__doc__ and not cls.__doc__.startswith(cls.__name__) else ""
    out = [f"{title}: `{cls.__name__}`" + (f". {' '.join(doc.split())}" if doc else ""), ""]
    fields = [f for f in dataclasses.fields(cls) if f.name != "op"]
    if not fields:
        return [*out, "(no fields)", ""]
    comments = field_comments(cls)
    rows = [(f"`{f.name}`", _type(f), _default(f), comments.get(f.name, "")) for f in fields]
    return [*out, *table(("field", "type", "default", "meaning"), rows), ""]


def field_comments(cls: type[Any]) -> dict[str, str]:
    """The comment of each field: on its line, else the comment lines just above."""
    out: dict[str, str] = {}
    above: list[str] = []
    for line in inspect.getsource(cls).splitlines()[1:]:
        comment = _COMMENT.match(line)
        if comment:
            above.append(comment.group(1))
            continue
        match = _FIELD.match(line)
        if match and not line.lstrip().startswith(("def ", "@", "return")):
            text = match.group(2) or " ".join(above)
            if text:
                out[match.group(1)] = text
        above = []
    return out


def _type(f: dataclasses.Field[Any]) -> str:
    # An enum field travels as its value: the page gives the wire's type.
    return f"`{type(f.default.value).__name__}`" if isinstance(f.default, Enum) else f"`{f.type}`"


def _default(f: dataclasses.Field[Any]) -> str:
    if isinstance(f.default, Enum):
        return f"`{f.default.value!r}`"
    if f.default is not dataclasses.MISSING:
        return f"`{f.default!r}`"
    if f.default_factory is not dataclasses.MISSING:
        return f"`{f.default_factory()!r}`"
    return "required"


def _constants(*prefixes: str) -> list[tuple[str, str, str]]:
    """``NAME = value  # comment`` lines of :mod:`kvstrata.sidecar.wire`."""
    out = []
    for line in inspect.getsource(wire).splitlines():
        match = _CONSTANT.match(line)
        if match and match.group(1).startswith(prefixes):
            name = match.group(1)
            out.append((name, str(getattr(wire, name)), match.group(3) or ""))
    return out
