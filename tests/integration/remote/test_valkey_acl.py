"""Shared-tier isolation as the README configures it: each KVCache its own key
prefix and its own Valkey ACL user limited to that prefix (``~prefix*``), on a
real server. A sidecar pointed at another cache's prefix reads nothing."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from kvstrata.operator.spec import default_key_prefix
from kvstrata.sidecar.config import SharedConfig
from kvstrata.sidecar.keys import Namespace, make_key
from kvstrata.sidecar.objformat import ChunkMeta
from kvstrata.sidecar.tiers.valkey import ValkeyTier

META = ChunkMeta(dtype="uint8", shape=(4096,))
KEY = make_key(Namespace(model="acl").fingerprint(), b"\x05" * 32)
PAYLOAD = bytes(range(256)) * 16
USERS = {"kvc-a": default_key_prefix("a", "team-1"), "kvc-b": default_key_prefix("b", "team-1")}


@pytest.fixture
def acl_users(valkey_server: Any, tmp_path: Path) -> Iterator[dict[str, Path]]:
    """One ACL user per KVCache, limited to its prefix; their password files."""
    admin = redis.Redis.from_url(valkey_server.url)
    files = {}
    for user, prefix in USERS.items():
        admin.execute_command(
            "ACL", "SETUSER", user, "reset", "on", f">{user}-pw", f"~{prefix}*", "+@all",
            "-@dangerous",
        )  # fmt: skip
        files[user] = tmp_path / f"{user}.pw"
        files[user].write_text(f"{user}-pw")
    yield files
    for user in USERS:
        admin.execute_command("ACL", "DELUSER", user)
    admin.close()


def _tier(url: str, user: str, password_file: Path, prefix: str) -> ValkeyTier:
    valkey = {"url": url, "username": user, "password_file": str(password_file)}
    valkey["key_prefix"] = prefix
    return ValkeyTier(SharedConfig(backend="valkey", valkey=valkey))


def test_an_acl_user_limited_to_its_prefix_cannot_read_or_write_another_caches_chunks(
    valkey_server: Any, acl_users: dict[str, Path]
):
    a_prefix, b_prefix = USERS["kvc-a"], USERS["kvc-b"]
    a = _tier(valkey_server.url, "kvc-a", acl_users["kvc-a"], a_prefix)
    b = _tier(valkey_server.url, "kvc-b", acl_users["kvc-b"], b_prefix)
    # kvc-b's credentials with kvc-a's prefix: a misconfigured or hostile sidecar.
    intruder = _tier(valkey_server.url, "kvc-b", acl_users["kvc-b"], a_prefix)
    try:
        assert a.put(KEY, PAYLOAD, META)
        assert b.get(KEY) is None  # its own prefix: another cache's key space
        assert intruder.get(KEY) is None
        assert intruder.contains_many([KEY]) == [False]
        assert not intruder.put(KEY, b"\x00" * len(PAYLOAD), META)
        got = a.get(KEY)
        assert got is not None and bytes(got.payload) == PAYLOAD
        assert b.put(KEY, PAYLOAD, META) and b.get(KEY) is not None
    finally:
        for tier in (a, b, intruder):
            tier.close()
