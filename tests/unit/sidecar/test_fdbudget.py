"""How the sidecar shares its descriptors between its listeners (plain functions)."""

from __future__ import annotations

from kvstrata.sidecar import protocol as p
from kvstrata.sidecar.fdbudget import RESERVE_MIN, ListenerCounts, plan
from kvstrata.sidecar.replies import request_id_of


def test_half_the_free_descriptors_are_kept_and_the_rest_is_split_in_three():
    budget = plan(nofile=1024, in_use=24)
    assert budget.reserve == 500
    assert budget.http == budget.liveness == 166
    assert budget.zmq == 83  # half a share: one connection per vLLM process is plenty
    assert budget.http + budget.liveness + budget.zmq + budget.reserve <= 1000
    # Every listener keeps its connections below the upper half of the reserve.
    assert {budget.fd_ceiling(n) for n in ("http", "liveness", "zmq")} == {1024 - 250}


def test_a_process_out_of_descriptors_still_keeps_a_reserve_and_small_caps():
    budget = plan(nofile=256, in_use=300)
    assert budget.reserve == RESERVE_MIN
    assert min(budget.http, budget.liveness, budget.zmq) > 0
    assert budget.fd_ceiling("zmq") == 256 - RESERVE_MIN // 2


def test_listener_counts_keep_every_descriptor_until_a_budget_says_otherwise():
    counts = ListenerCounts(limit=8)
    assert counts.fd_ceiling > 1 << 19


def test_the_request_id_of_a_reply_is_read_without_its_body():
    reply = p.encode_error(4242, p.E_BUSY, "x" * 100_000)
    assert request_id_of(reply) == 4242
    assert request_id_of(b"\xc1 not msgpack") == 0
