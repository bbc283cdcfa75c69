"""What every section of the sidecar's config shares: the strict base model
and byte sizes.

Why a module of its own: :mod:`.config` assembles the whole schema from
sections, and sections that live in modules of their own
(:mod:`.tenant_config`) need the same base and the same size parsing
without importing the schema that imports them.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

__all__ = ["ByteSize", "ConfigSection", "parse_quantity"]

_QUANTITY_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*$")
_QUANTITY_SUFFIXES: dict[str, int] = {
    "": 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
}


def parse_quantity(value: int | float | str) -> int:
    """Parse a byte size: an integer, or a Kubernetes quantity like ``4Gi``.

    Raises ``ValueError`` naming the accepted suffixes on anything else.
    """
    if isinstance(value, bool):
        raise ValueError(f"expected a byte size, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"byte size must be >= 0, got {value}")
        return value
    if isinstance(value, float):
        if value < 0 or value != value:
            raise ValueError(f"byte size must be >= 0, got {value}")
        return int(value)
    if isinstance(value, str):
        match = _QUANTITY_RE.match(value)
        if match and match.group(2) in _QUANTITY_SUFFIXES:
            return int(float(match.group(1)) * _QUANTITY_SUFFIXES[match.group(2)])
    suffixes = ", ".join(s for s in _QUANTITY_SUFFIXES if s)
    raise ValueError(
        f"expected a byte size (an integer or a quantity with suffix {suffixes}), got {value!r}"
    )


ByteSize = Annotated[int, BeforeValidator(parse_quantity), Field(ge=0)]


class ConfigSection(BaseModel):
    # Unknown keys are refused: a typo in a ConfigMap must not silently fall
    # back to a default.
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
