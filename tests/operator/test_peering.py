"""kopf peering options: one replica reconciles, chosen by a priority per pod."""

from __future__ import annotations

import argparse

from kvstrata.operator import main
from kvstrata.operator.peering import priority_of, run_options


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    main.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_without_a_peering_name_the_operator_runs_standalone():
    args = parse()
    assert args.peering == ""
    assert run_options(args.peering, args.priority, "kvstrata-abc") == {"standalone": True}


def test_replicas_of_one_deployment_get_distinct_priorities_so_exactly_one_reconciles():
    # Equal priorities make kopf pause every peer: the replicas' must differ.
    names = [f"kvstrata-operator-7d9c5b-{suffix}" for suffix in ("x2k4p", "q8m1z", "a0b1c")]
    priorities = [run_options("kvstrata", None, name)["priority"] for name in names]
    assert len(set(priorities)) == len(names)
    assert all(p >= 0 for p in priorities)
    # Stable across restarts of the same pod name (a restarted container keeps its rank).
    assert priorities[0] == priority_of(names[0])


def test_an_explicit_priority_and_the_peering_name_reach_kopf(monkeypatch):
    monkeypatch.setenv("KVSTRATA_OPERATOR_PEERING", "kvstrata-release")
    args = parse("--priority", "7")
    assert run_options(args.peering, args.priority, "ignored") == {
        "standalone": False,
        "peering_name": "kvstrata-release",
        "priority": 7,
    }
