"""The transfer mode: who copies a session's chunks between vLLM's KV and L1.

Why a module of its own: the mode arrives as a string at three boundaries,
the sidecar's config (``transfer_mode``), the connector's extra config
(``kv_connector_extra_config.transfer_mode``) and the HELLO bodies on the
wire (msgpack strings, unchanged), and each boundary parses it here, once,
into a member of :class:`TransferMode` (what a session runs in) or
:class:`ModeSetting` (what a config asks for, ``auto`` included). Code past
those boundaries compares members; a bare ``"ipc"`` compared with a mode
would be a typo waiting to be always false, and
``tests/unit/test_transfer_mode_strings.py`` fails when one comes back.

The modes themselves are described in ``docs/architecture.md`` (Data path).
"""

from __future__ import annotations

from enum import Enum
from typing import TypeVar

__all__ = ["ModeSetting", "TransferMode", "UnknownMode", "parse"]

_E = TypeVar("_E", "TransferMode", "ModeSetting")


class TransferMode(Enum):
    """The mode a session runs in, granted at HELLO."""

    # The connector copies through the shared-memory arena (PREPARE / COMMIT).
    HOST = "host"
    # The sidecar copies, between its arena and KV tensors registered by CUDA IPC.
    IPC = "ipc"


class ModeSetting(Enum):
    """What a sidecar's or a connector's config asks for."""

    # ipc where it can be served (a CUDA KV cache, a sidecar that sees the GPU), else host.
    AUTO = "auto"
    IPC = "ipc"
    HOST = "host"

    @property
    def may_use_ipc(self) -> bool:
        """Whether ipc mode is worth trying under this setting."""
        return self is not ModeSetting.HOST


class UnknownMode(ValueError):
    """A mode string that names no member; the message names it and the known ones."""


def parse(kind: type[_E], value: object, where: str) -> _E:
    """``value`` as a member of ``kind``; :class:`UnknownMode` naming ``where``,
    the value and the known modes when it is none of them."""
    for member in kind:
        if member.value == value:
            return member
    known = ", ".join(m.value for m in kind)
    raise UnknownMode(f"{where} must be one of {known}, not {value!r}")
