"""Who may still hold a lease: ended clients (bounded) and prefetch owners."""

from __future__ import annotations

from kvstrata.sidecar.owners import EndedClients, PrefetchOwners

from ..conftest import make_key


def test_ended_clients_forget_the_oldest_ending_past_their_bound():
    ended = EndedClients(limit=2)
    for client in ("a", "b", "c"):
        ended.add(client)
    assert "a" not in ended
    assert "b" in ended and ended.has_owner("c/req-1")
    assert not ended.has_owner("d/req-1")


def test_a_released_owner_learns_it_once_per_landing_and_is_forgotten_with_its_last_key():
    owners = PrefetchOwners()
    owners.expect("s1/a", [make_key(1), make_key(2)])
    owners.expect("s2/a", [make_key(3)])
    owners.release_client("s1")
    owners.release_owner("s2/b")  # nothing on its way: nothing to remember
    assert owners.queued() == 3
    assert owners.landed("s1/a", make_key(1))
    assert owners.landed("s1/a", make_key(2))
    assert not owners.landed("s2/a", make_key(3))
    assert owners.queued() == 0
    owners.expect("s1/a", [make_key(1)])  # a new request under the same owner
    assert not owners.landed("s1/a", make_key(1))
