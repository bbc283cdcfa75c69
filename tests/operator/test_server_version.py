"""The API server's version decides whether the sidecar (a native sidecar) can be injected."""

from __future__ import annotations

import pytest

from kvstrata.operator.serverversion import VersionCache, parse_version, unsupported_reason


@pytest.mark.parametrize(
    ("info", "expected"),
    [
        ({"major": "1", "minor": "29", "gitVersion": "v1.29.3"}, (1, 29)),
        ({"major": "1", "minor": "30+", "gitVersion": "v1.30.2-gke.1587003"}, (1, 30)),
        ({"major": "", "minor": "", "gitVersion": "v1.31.0-eks-a737599"}, (1, 31)),
    ],
)
def test_the_version_is_read_as_managed_clusters_report_it(info, expected):
    version = parse_version(info)
    assert (version.major, version.minor) == expected


def test_an_answer_without_a_version_is_refused_naming_it():
    with pytest.raises(ValueError, match="no version number"):
        parse_version({"gitVersion": "unknown"})


def test_1_28_is_below_the_floor_and_1_29_is_not():
    # SidecarContainers: alpha (off) in 1.28, beta and on by default from 1.29.
    old = unsupported_reason(parse_version({"major": "1", "minor": "28", "gitVersion": "v1.28.7"}))
    assert old is not None and "v1.28.7" in old and "1.29 or later" in old
    assert unsupported_reason(parse_version({"major": "1", "minor": "29"})) is None
    assert unsupported_reason(parse_version({"major": "2", "minor": "0"})) is None


class Steps:
    """A clock moved by the test, and a /version that answers what the test says."""

    def __init__(self) -> None:
        self.now = 0.0
        self.answers: list[dict | Exception] = []
        self.fetches = 0

    def clock(self) -> float:
        return self.now

    def fetch(self) -> dict:
        self.fetches += 1
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


def test_the_version_is_fetched_once_per_refresh_and_an_upgrade_is_noticed():
    steps = Steps()
    cache = VersionCache(steps.fetch, refresh_s=300, clock=steps.clock)
    steps.answers = [{"major": "1", "minor": "28", "gitVersion": "v1.28.7"}]
    assert "1.29 or later" in cache.reason()
    steps.now = 299
    assert "1.29 or later" in cache.reason() and steps.fetches == 1
    steps.now = 300
    steps.answers = [{"major": "1", "minor": "29", "gitVersion": "v1.29.0"}]
    assert cache.reason() is None and steps.fetches == 2


def test_an_unreadable_version_skips_until_known_then_keeps_the_last_known():
    steps = Steps()
    cache = VersionCache(steps.fetch, refresh_s=300, clock=steps.clock)
    steps.answers = [RuntimeError("connection refused")]
    assert cache.reason() == "cannot read the API server's version: connection refused"
    steps.answers = [{"major": "1", "minor": "33"}]  # the next call tries again
    assert cache.reason() is None
    steps.now = 600
    steps.answers = [RuntimeError("timeout")]
    assert cache.reason() is None  # the last version known stands


def test_the_chart_states_the_same_floor_as_the_operator():
    from pathlib import Path

    import yaml

    from kvstrata.operator.serverversion import MINIMUM

    chart = Path(__file__).resolve().parents[2] / "charts" / "kvstrata" / "Chart.yaml"
    floor = ".".join(map(str, MINIMUM))
    assert yaml.safe_load(chart.read_text())["kubeVersion"] == f">={floor}.0-0"
    readme = (chart.parents[2] / "README.md").read_text()
    assert f"Supported: Kubernetes {floor} through" in readme
