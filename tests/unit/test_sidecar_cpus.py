"""The sidecar's CPU list (``cpus``): parsing, formatting, refusing CPUs it may not use."""

from __future__ import annotations

import os

import pytest

from kvstrata.sidecar.config import ConfigError, config_from_dict, load_config
from kvstrata.sidecar.cpus import format_cpu_list, parse_cpu_list, pin_process


@pytest.mark.parametrize(
    ("text", "cpus"),
    [
        ("1", {1}),
        ("0-2,5", {0, 1, 2, 5}),
        (" 3 , 1-2", {1, 2, 3}),
        ("4-4", {4}),
        ("7,7,6-7", {6, 7}),
    ],
)
def test_cpu_lists_parse_as_cpuset_7_writes_them(text: str, cpus: set[int]):
    assert parse_cpu_list(text) == frozenset(cpus)


@pytest.mark.parametrize(
    ("text", "named"),
    [("", "''"), ("a", "'a'"), ("3-1", "'3-1'"), ("1,,2", "''"), ("-1", "'-1'"), ("1-", "'1-'")],
)
def test_a_bad_cpu_list_names_the_part_that_is_wrong(text: str, named: str):
    with pytest.raises(ValueError, match=named):
        parse_cpu_list(text)


@pytest.mark.parametrize(
    ("cpus", "text"),
    [({0, 1, 2, 5}, "0-2,5"), ({3}, "3"), ({1, 3, 5}, "1,3,5"), ({8, 9, 10, 11}, "8-11")],
)
def test_cpu_sets_format_as_the_shortest_list_and_parse_back(cpus: set[int], text: str):
    assert format_cpu_list(cpus) == text
    assert parse_cpu_list(text) == frozenset(cpus)


def test_pinning_to_a_cpu_the_process_may_not_use_is_refused_naming_it():
    before = os.sched_getaffinity(0)
    beyond = max(before) + 1000
    with pytest.raises(ValueError, match=f"CPU\\(s\\) {beyond} are not among"):
        pin_process(frozenset({beyond}))
    assert os.sched_getaffinity(0) == before  # nothing was pinned on the way


def test_the_config_takes_a_cpu_list_from_yaml_or_the_environment():
    assert config_from_dict({"cpus": "0-1"}).cpus == "0-1"
    # KVSTRATA_CPUS=1 reads as YAML, the number 1: kept as the list "1".
    assert load_config(env={"KVSTRATA_CPUS": "1"}).cpus == "1"
    assert config_from_dict({}).cpus is None


@pytest.mark.parametrize("value", ["1-0", "one", True, 1.5])
def test_a_bad_cpus_setting_is_refused_naming_the_field(value: object):
    with pytest.raises(ConfigError, match="cpus"):
        config_from_dict({"cpus": value})
