"""Where ``kvstrata bench serve`` puts the sidecar: on the cores vLLM reserves,
checked against what vLLM logged (bench/serve.py ``sidecar_cpus``)."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest

from kvstrata.bench.serve import Plan, check_sidecar_cpus, sidecar_cpus
from kvstrata.sidecar.cpus import parse_cpu_list


def test_reserved_means_the_last_cpus_this_process_may_use():
    allowed = sorted(os.sched_getaffinity(0))
    plan = replace(Plan(), reserved_cpus=1)
    if len(allowed) <= 1:
        assert sidecar_cpus(plan) == ""  # nothing kept apart: the sidecar stays unpinned
    else:
        assert parse_cpu_list(sidecar_cpus(plan)) == {allowed[-1]}


def test_an_explicit_list_or_none_is_taken_as_given():
    assert sidecar_cpus(replace(Plan(), sidecar_cpus="3-4")) == "3-4"
    assert sidecar_cpus(replace(Plan(), sidecar_cpus="")) == ""


def test_a_sidecar_inside_the_reserved_cores_passes():
    check_sidecar_cpus("1", {"reserved_cpus": "1"})
    check_sidecar_cpus("2", {"reserved_cpus": "2,3"})
    check_sidecar_cpus("", None)  # unpinned: nothing to check


@pytest.mark.parametrize("binding", [{"reserved_cpus": "0"}, {"reserved_cpus": ""}, None])
def test_a_sidecar_outside_what_vllm_reserved_stops_the_run(binding):
    with pytest.raises(RuntimeError, match="the sidecar ran on CPU"):
        check_sidecar_cpus("1", binding)
