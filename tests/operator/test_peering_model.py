"""What a peering replica says and does, on kopf's own peering code, without a cluster.

Why: the k8s suite's peering test once waited for the lower-priority replica
to log "Pausing operations", and failed whenever that replica's first view of
the peering already held the higher one's keep-alive (at 1.29.4, 2 runs of 2
on the merged tree; the "Resuming operations" it did log came a minute later,
when the higher replica said farewell at the test's end). kopf starts a
replica with mandatory peering paused (``spawn_missing_peerings`` makes its
toggle pre-activated) and logs the pause only when an active replica pauses.
Whether the line came depended on which came first: the second replica's
first listing of the peering, or the first replica's first keep-alive. The
test now starts the second replica after the first one's keep-alive is
stored, the order in which it is never active (the first case below).

Each case feeds kopf's ``process_peering_event`` the peering objects a
replica lists or is sent, in order, with a toggle as kopf makes it.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
from typing import Any

import pytest
from kopf._cogs.aiokits import aiotoggles
from kopf._cogs.configs import configuration
from kopf._cogs.structs import references
from kopf._core.engines import peering

LOW, HIGH = 1, 2
RESOURCE = references.Resource(
    group="kopf.dev", version="v1", plural="kopfpeerings", kind="KopfPeering", namespaced=True
)


def keep_alive(priority: int) -> dict[str, Any]:
    """A peer's entry as kopf writes it, just now, with kopf's default lifetime."""
    now = datetime.datetime.now(datetime.UTC).isoformat()
    return {"priority": priority, "lifetime": 60, "lastseen": now}


def peering_object(**peers: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "kopf.dev/v1",
        "kind": "KopfPeering",
        "metadata": {"name": "kvstrata", "namespace": "ml"},
        "status": peers,
    }


async def low_replica_sees(*views: dict[str, Any]) -> list[bool]:
    """The lower-priority replica's paused state after each view of the peering, in order."""
    settings = configuration.OperatorSettings()
    settings.peering.name = "kvstrata"
    settings.peering.priority = LOW
    settings.peering.mandatory = True
    # As kopf's spawn_missing_peerings makes it: pre-activated when peering is mandatory.
    paused = aiotoggles.Toggle(settings.peering.mandatory, name="kvstrata@ml")
    # kopf sleeps until a blocking peer's deadline unless the stream has more: say it has.
    more_events = asyncio.Event()
    more_events.set()
    states = []
    for view in views:
        await peering.process_peering_event(
            raw_event={"type": "MODIFIED", "object": view},  # type: ignore[typeddict-item]
            namespace="ml",
            resource=RESOURCE,
            identity=peering.Identity("low"),
            settings=settings,
            autoclean=False,
            stream_pressure=more_events,
            conflicts_found=paused,
        )
        states.append(paused.is_on())
    return states


def said(caplog: pytest.LogCaptureFixture, words: str) -> bool:
    return any(words in record.getMessage() for record in caplog.records)


def test_a_replica_whose_first_view_holds_a_live_higher_peer_stays_paused_without_a_word(
    caplog,
):
    caplog.set_level(logging.DEBUG, logger="kopf")
    views = [
        peering_object(high=keep_alive(HIGH)),
        peering_object(high=keep_alive(HIGH), low=keep_alive(LOW)),
    ]
    assert asyncio.run(low_replica_sees(*views)) == [True, True]
    # Never active, so never "Pausing": a wait for that line never ends.
    assert not said(caplog, "Pausing operations")
    assert not said(caplog, "Resuming operations")


def test_a_replica_that_lists_the_peering_before_the_higher_keep_alive_is_active_for_a_while(
    caplog,
):
    caplog.set_level(logging.DEBUG, logger="kopf")
    views = [
        peering_object(),  # listed before the other replica's first keep-alive
        peering_object(low=keep_alive(LOW)),
        peering_object(low=keep_alive(LOW), high=keep_alive(HIGH)),
    ]
    # Active (it could reconcile) until the higher replica's keep-alive reaches it.
    assert asyncio.run(low_replica_sees(*views)) == [False, False, True]
    assert said(caplog, "Resuming operations") and said(caplog, "Pausing operations")


def test_a_replica_takes_over_when_the_higher_one_says_farewell(caplog):
    caplog.set_level(logging.DEBUG, logger="kopf")
    views = [
        peering_object(high=keep_alive(HIGH), low=keep_alive(LOW)),
        peering_object(low=keep_alive(LOW)),  # the farewell took the higher entry out
    ]
    assert asyncio.run(low_replica_sees(*views)) == [True, False]
    assert said(caplog, "Resuming operations")
