"""``kvstrata bench remote --param``: the encryption rows alone, sizes and runs,
and a bad setting refused before anything starts, naming it."""

from __future__ import annotations

import argparse

import pytest

from kvstrata.bench import main as bench_main
from kvstrata.bench.remote import plan_from


def args(*params: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_main.add_arguments(parser)
    return parser.parse_args(["remote", *[a for p in params for a in ("--param", p)]])


def test_the_encryption_rows_run_alone_with_the_sizes_and_runs_asked_for() -> None:
    params = plan_from(args("parts=encryption", "sizes_mib=1,4,16", "reps=3"))
    assert (params["parts"], params["sizes_mib"], params["reps"]) == ("encryption", [1, 4, 16], 3)
    assert plan_from(args())["parts"] == "all"


@pytest.mark.parametrize(
    ("param", "named"),
    [
        ("parts=codecs", "one of all, encryption"),
        ("sizes_mib=0", "between 1 and 64"),
        ("reps=x", "reps=x"),
        ("batch=4", "KEY one of parts, reps, sizes_mib"),
    ],
)
def test_a_bad_setting_is_refused_naming_it(param: str, named: str) -> None:
    message = bench_main.check_arguments(args(param))
    assert message is not None and param in message and named in message
