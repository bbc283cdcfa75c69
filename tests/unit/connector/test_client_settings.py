"""A client's settings are chosen when it is made; a call that needs another
deadline or another filling of its arena mapping says so as an argument.

Why: the worker used to swap its client's ``call_timeout_s`` (and
``populate_arena``) around one call and put it back after. Any other call
on the same client meanwhile (the client is shared between threads) ran
under the swapped value, and a call that raised between the two writes
would have left it swapped for good. Now the settings are read-only
properties and :meth:`SidecarSession.connect` takes the one call's deadline
and mapping mode; an AST scan keeps every module off the settings.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kvstrata.connector.client import SidecarClient
from kvstrata.connector.client_arena import Populate
from kvstrata.sidecar.keys import Namespace
from kvstrata.sidecar.transfer_mode import TransferMode

REPO = Path(__file__).resolve().parents[3]
# The session keeps them in private fields, written once in its constructor
# (and requested_mode by register_kv): no module writes these names.
SETTINGS = ("call_timeout_s", "populate_arena", "requested_mode")


def _client(tmp_path: Path, **kwargs: object) -> SidecarClient:
    return SidecarClient(
        f"ipc://{tmp_path}/absent.sock", Namespace(model="m"), role="worker", **kwargs
    )


@pytest.mark.parametrize(
    ("name", "value"),
    [("call_timeout_s", 120.0), ("populate_arena", Populate.NOW), ("requested_mode", "ipc")],
)
def test_a_clients_settings_cannot_be_changed_after_it_is_made(
    tmp_path: Path, name: str, value: object
) -> None:
    client = _client(tmp_path, call_timeout_s=0.5)
    try:
        before = getattr(client, name)
        with pytest.raises(AttributeError):
            setattr(client, name, value)
        assert getattr(client, name) == before
    finally:
        client.close()


def test_the_settings_read_back_as_made(tmp_path: Path) -> None:
    client = _client(tmp_path, call_timeout_s=0.25, populate_arena="off")
    try:
        assert client.call_timeout_s == 0.25
        assert client.populate_arena is Populate.OFF
        assert client.requested_mode is TransferMode.HOST
    finally:
        client.close()


def test_an_unknown_populate_mode_is_refused_naming_it_and_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="populate_arena: 'eager' is not one of now, background"):
        _client(tmp_path, populate_arena="eager")


def setting_writes(source: str) -> list[tuple[int, str]]:
    """``(line, attribute)`` of each assignment to one of :data:`SETTINGS`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        else:
            continue
        for target in targets:
            for sub in ast.walk(target):
                if isinstance(sub, ast.Attribute) and sub.attr in SETTINGS:
                    found.append((node.lineno, sub.attr))
    return found


def test_the_scan_finds_each_form_of_a_write() -> None:
    source = (
        "self.client.call_timeout_s = 5\n"
        "client.populate_arena = 'now'\n"
        "a, c.requested_mode = 1, 2\n"
        "client.call_timeout_s += 1\n"
        "timeout = client.call_timeout_s\n"
    )
    assert setting_writes(source) == [
        (1, "call_timeout_s"),
        (2, "populate_arena"),
        (3, "requested_mode"),
        (4, "call_timeout_s"),
    ]


def test_no_module_writes_a_clients_settings() -> None:
    modules = sorted(
        {
            path
            for top in ("connector", "sidecar", "src/kvstrata", "bench")
            for path in (REPO / top).rglob("*.py")
            if not path.is_symlink()
        }
    )
    assert REPO / "connector" / "worker.py" in modules
    bad = [
        f"{path.relative_to(REPO)}:{line}: {name}"
        for path in modules
        for line, name in setting_writes(path.read_text())
    ]
    assert bad == [], f"pass a call's own deadline or mapping mode to connect(): {bad}"
