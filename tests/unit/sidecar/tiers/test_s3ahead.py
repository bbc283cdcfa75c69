"""HeldGets: the bounds on GET responses a lookup holds (no network: each
response is a stand-in whose only behaviour is being closed)."""

from __future__ import annotations

from typing import Any

from kvstrata.sidecar.tiers.s3ahead import HeldGets


class _Body:
    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _response() -> dict[str, Any]:
    return {"Body": _Body()}


def test_a_held_response_is_taken_once_and_never_closed_by_the_table():
    held = HeldGets(capacity=4, ttl=5.0, clock=_Clock())
    response = _response()
    held.hold("a", response)
    assert held.holds("a") and held.room() == 3
    assert held.take("a") is response
    assert held.take("a") is None
    assert not response["Body"].closed
    assert held.taken_total == 1 and held.closed_unread_total == 0


def test_the_oldest_is_closed_beyond_capacity():
    held = HeldGets(capacity=2, ttl=5.0, clock=_Clock())
    first, second, third = _response(), _response(), _response()
    held.hold("a", first)
    held.hold("b", second)
    assert held.room() == 0
    held.hold("c", third)
    assert first["Body"].closed and not second["Body"].closed
    assert held.take("a") is None and held.take("c") is third
    assert held.closed_unread_total == 1


def test_a_response_held_past_its_ttl_is_closed_by_the_next_call_that_looks():
    clock = _Clock()
    held = HeldGets(capacity=4, ttl=5.0, clock=clock)
    old = _response()
    held.hold("a", old)
    clock.now += 4.9
    young = _response()
    held.hold("b", young)
    clock.now += 0.2  # "a" is 5.1 s old, "b" 0.2 s
    assert held.take("a") is None
    assert old["Body"].closed
    assert held.holds("b") and not young["Body"].closed


def test_holding_a_name_again_closes_the_response_it_replaces():
    held = HeldGets(capacity=4, ttl=5.0, clock=_Clock())
    before, after = _response(), _response()
    held.hold("a", before)
    held.hold("a", after)
    assert before["Body"].closed
    assert held.take("a") is after


def test_drop_and_close_all_close_what_they_remove():
    held = HeldGets(capacity=4, ttl=5.0, clock=_Clock())
    responses = {name: _response() for name in "abc"}
    for name, response in responses.items():
        held.hold(name, response)
    held.drop("a")
    held.drop("missing")
    assert responses["a"]["Body"].closed and not responses["b"]["Body"].closed
    held.close_all()
    assert all(r["Body"].closed for r in responses.values())
    assert held.room() == 4 and held.closed_unread_total == 3


def test_a_discarded_response_is_closed_and_counted_without_being_held():
    held = HeldGets(capacity=1, ttl=5.0, clock=_Clock())
    kept, unwanted = _response(), _response()
    held.hold("a", kept)
    held.discard(unwanted)
    assert unwanted["Body"].closed and not kept["Body"].closed
    assert held.closed_unread_total == 1 and held.take("a") is kept
