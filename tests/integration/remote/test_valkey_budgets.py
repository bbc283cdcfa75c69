"""Per-tenant byte budgets in the Valkey tier (``tenants[].budgets.shared_bytes``):
one ledger on a real server, shared by every tier ("sidecar") on the key
prefix, standalone and cluster. Expiry is awaited on the server's own state
(the objects gone), never assumed from the clock."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from kvstrata.sidecar.config import SharedConfig
from kvstrata.sidecar.keys import ChunkKey, Namespace, key_hex, make_key
from kvstrata.sidecar.objformat import ChunkMeta, encode_streamed
from kvstrata.sidecar.tiers.valkey import ValkeyTier
from kvstrata.sidecar.tiers.valkey_ledger import HELD, RESERVED, SharedBudgets
from kvstrata.testing.poll import wait_until

NS = Namespace(model="valkey-budgets").fingerprint()
PAYLOAD = bytes(range(256)) * 64  # 16 KiB
A = ChunkMeta(dtype="uint8", shape=(len(PAYLOAD),), tenant="team-a")
B = ChunkMeta(dtype="uint8", shape=(len(PAYLOAD),), tenant="team-b")
# Long enough for the first phase's ten round trips on a loaded machine; the
# test then waits on the server until these objects are gone.
TTL_SECONDS = 4.0


def key(i: int) -> ChunkKey:
    return make_key(NS, i.to_bytes(32, "big"))


def object_bytes(meta: ChunkMeta) -> int:
    """What one stored object of ``meta`` counts against a budget."""
    obj = encode_streamed(bytes(key(0)), PAYLOAD, meta, "none", None)
    try:
        return len(obj)
    finally:
        obj.release()


SIZE = object_bytes(A)
BUDGET = 3 * SIZE + SIZE // 2  # three objects fit, a fourth does not


def refusals(tier: ValkeyTier, tenant: str) -> int:
    figures = tier.tenant_figures()
    assert figures is not None
    return figures.refusals.get((tenant, "budget"), 0)


def usage(tier: ValkeyTier) -> dict[str, int]:
    figures = tier.tenant_figures()
    assert figures is not None
    return figures.usage


@pytest.fixture(params=["standalone", "cluster"])
def tiers(
    request: pytest.FixtureRequest, valkey_config: Callable[..., SharedConfig]
) -> Iterator[tuple[Callable[..., ValkeyTier], Any]]:
    """``make(**budgets)``: tiers on one server and one key prefix (one per
    "sidecar"), team-a's TTL short; and a plain client of that server."""
    cluster = request.param == "cluster"
    server = request.getfixturevalue("valkey_cluster" if cluster else "valkey_server")
    config = valkey_config(server.url, cluster=cluster)
    made: list[ValkeyTier] = []

    def make(**budgets: int) -> ValkeyTier:
        tier = ValkeyTier(
            config,
            tenant_ttl_seconds={"team-a": TTL_SECONDS, "team-b": 3600.0},
            tenant_budgets=budgets,
        )
        made.append(tier)
        return tier

    raw = (
        redis.cluster.RedisCluster.from_url(server.url)
        if cluster
        else redis.Redis.from_url(server.url)
    )
    yield make, raw
    for tier in made:
        tier.clear()
        tier.close()
    raw.close()


def test_two_sidecars_share_one_tenants_budget_until_its_objects_expire(tiers: Any) -> None:
    make, raw = tiers
    one = make(**{"team-a": BUDGET, "team-b": 100 * SIZE})
    two = make(**{"team-a": BUDGET, "team-b": 100 * SIZE})
    first = [key(i) for i in range(10)]
    # The two sidecars take turns: together they hold team-a to its budget.
    stored = [(one if i % 2 else two).put_outcome(k, PAYLOAD, A) for i, k in enumerate(first)]
    assert stored.count("stored") == BUDGET // SIZE == 3
    assert stored.count("failed") == 7
    assert refusals(one, "team-a") + refusals(two, "team-a") == 7
    held = [k for k, outcome in zip(first, stored, strict=True) if outcome == "stored"]
    assert one.contains_many(first) == [k in held for k in first]

    # team-b has a budget of its own: team-a's being full costs it nothing.
    assert all(one.put(key(100 + i), PAYLOAD, B) for i in range(5))
    assert refusals(one, "team-b") == refusals(two, "team-b") == 0
    # Both sidecars read what the one ledger per tenant counts.
    assert usage(one) == usage(two) == {"team-a": 3 * SIZE, "team-b": 5 * SIZE}

    # Once team-a's objects have expired on the server, its budget is free again.
    prefix = one._prefix
    wait_until(
        lambda: raw.exists(*(prefix + key_hex(k) for k in held)) == 0,
        30,
        "team-a's objects expiring on the server",
    )
    assert usage(one)["team-a"] == 0  # expired members no longer count, purged or not
    again = [two.put_outcome(key(200 + i), PAYLOAD, A) for i in range(4)]
    assert again == ["stored", "stored", "stored", "failed"]
    assert refusals(one, "team-a") + refusals(two, "team-a") == 8


def test_a_set_nx_that_finds_the_object_present_gives_its_reservation_back(
    tiers: Any,
) -> None:
    make, raw = tiers
    tier = make(**{"team-a": BUDGET})
    # The object is there already, with no reservation in the ledger (stored
    # before the tenant had a budget): the store finds it and yields.
    present = key(1)
    raw.set(tier._prefix + key_hex(present), b"stored-before-the-budget", px=60_000)
    assert tier.put_outcome(present, PAYLOAD, A) == "present"
    ledger, sizes = SharedBudgets(tier._prefix, {}).keys("team-a")
    assert raw.zscore(ledger, tier._prefix + key_hex(present)) is None
    # The whole budget is still there: three new objects fit.
    assert [tier.put_outcome(key(10 + i), PAYLOAD, A) for i in range(4)] == [
        "stored",
        "stored",
        "stored",
        "failed",
    ]
    assert int(raw.hget(sizes, ":total")) == 3 * SIZE


def test_an_object_another_writer_holds_is_asked_about_and_never_written_twice(
    tiers: Any,
) -> None:
    make, raw = tiers
    tier = make(**{"team-a": BUDGET})
    name = tier._prefix + key_hex(key(5))
    # Another sidecar has reserved the object and not yet sent it.
    other = SharedBudgets(tier._prefix, {"team-a": BUDGET})
    assert other.reserve(raw, ["team-a"], [name], [SIZE], [60_000]) == [RESERVED]
    assert tier.put_outcome(key(5), PAYLOAD, A) == "failed"  # not stored, not counted twice
    assert raw.exists(name) == 0
    assert refusals(tier, "team-a") == 0
    # Once the other writer's SET is in, this one finds the object and yields to it.
    raw.set(name, b"the-other-writers-bytes", px=60_000)
    assert tier.put_outcome(key(5), PAYLOAD, A) == "present"
    assert other.reserve(raw, ["team-a"], [name], [SIZE], [60_000]) == [HELD]
    _, sizes = other.keys("team-a")
    assert int(raw.hget(sizes, ":total")) == SIZE


def test_a_budget_needs_an_expiry(valkey_server: Any, valkey_config: Any) -> None:
    with pytest.raises(ValueError, match=r"'team-a': budgets\.shared_bytes needs an expiry"):
        ValkeyTier(valkey_config(valkey_server.url), tenant_budgets={"team-a": BUDGET})


@pytest.fixture
def no_scripts_user(valkey_server: Any, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """An ACL user that may read and write the keys but run no script."""
    admin = redis.Redis.from_url(valkey_server.url)
    admin.execute_command(
        "ACL", "SETUSER", "no-scripts", "reset", "on", ">no-scripts-pw", "~*", "+@all",
        "-@scripting",
    )  # fmt: skip
    password = tmp_path / "no-scripts.pw"
    password.write_text("no-scripts-pw")
    yield "no-scripts", password
    admin.execute_command("ACL", "DELUSER", "no-scripts")
    admin.close()


def test_a_ledger_the_server_refuses_is_the_tiers_failure_path_never_a_crash(
    valkey_server: Any, valkey_config: Any, no_scripts_user: tuple[str, Path]
) -> None:
    user, password = no_scripts_user
    config = valkey_config(
        valkey_server.url,
        valkey={"username": user, "password_file": str(password), "ttl_seconds": 60},
        breaker_failures=2,
    )
    tier = ValkeyTier(config, tenant_budgets={"team-a": BUDGET})
    try:
        assert tier.put_outcome(key(1), PAYLOAD, A) == "failed"
        assert tier.put_outcome(key(2), PAYLOAD, A) == "failed"
        stats = tier.stats()
        assert stats.errors_total == {"auth": 2}
        assert stats.breaker_state == "open"
        # Nothing was written without its reservation; a read is a plain miss.
        assert tier.get(key(1)) is None
        assert refusals(tier, "team-a") == 0
    finally:
        tier.close()


def test_a_batch_whose_second_tenant_the_ledger_refuses_gives_the_first_its_bytes_back(
    valkey_server: Any, valkey_config: Any
) -> None:
    """team-b's ledger keys hold strings (a real server fault: WRONGTYPE in
    its script) after team-a's reservation in the same batch went through."""
    tier = ValkeyTier(
        valkey_config(valkey_server.url, valkey={"ttl_seconds": 60}),
        tenant_budgets={"team-a": BUDGET, "team-b": BUDGET},
    )
    raw = redis.Redis.from_url(valkey_server.url)
    ledger = tier._budgets  # the keys its ledger uses
    try:
        for name in ledger.keys("team-b"):  # both: a ledger with one key is mended
            raw.set(name, b"not a ledger")
        batch = [(key(1), PAYLOAD, A), (key(2), PAYLOAD, B)]
        assert tier._put_outcomes(batch) == ["failed", "failed"]
        assert tier.stats().errors_total != {}
        assert tier.get(key(1)) is None  # nothing was sent
        # team-a's reservation went back: its whole budget is there again.
        assert raw.zcard(ledger.keys("team-a")[0]) == 0
        assert int(raw.hget(ledger.keys("team-a")[1], ":total") or 0) == 0
    finally:
        raw.delete(*ledger.keys("team-b"))
        tier.clear()
        tier.close()
        raw.close()


def test_a_server_that_forgot_the_scripts_has_them_loaded_again(
    valkey_server: Any, valkey_config: Any
) -> None:
    tier = ValkeyTier(
        valkey_config(valkey_server.url, valkey={"ttl_seconds": 60}),
        tenant_budgets={"team-a": BUDGET},
    )
    raw = redis.Redis.from_url(valkey_server.url)
    try:
        assert tier.put_outcome(key(1), PAYLOAD, A) == "stored"
        raw.script_flush()  # what a restarted server has: no scripts
        assert tier.put_outcome(key(2), PAYLOAD, A) == "stored"
        assert usage(tier) == {"team-a": 2 * SIZE}
        assert tier.stats().errors_total == {}
    finally:
        tier.clear()
        tier.close()
        raw.close()
