"""A slip on the ``kvstrata`` command line is one line naming what was wrong,
exit code 2 and no traceback, answered before anything slow starts.

The subprocess tests run the command as a user types it; the fuzz drives
:func:`kvstrata.cli.parse` (everything the command does before it starts a
sidecar, vLLM or kopf) with arbitrary flags and values.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstrata import cli


def kvstrata(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvstrata.cli", *argv],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=120,
    )


def assert_one_line_refusal(done: subprocess.CompletedProcess, *names: str) -> None:
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    for name in names:
        assert name in lines[0]


def test_zero_repeats_in_the_demo_is_refused_before_vllm_starts():
    done = kvstrata("demo", "--repeats", "0")
    assert_one_line_refusal(done, "kvstrata demo", "--repeats", "got 0")
    assert done.stdout == ""  # not even "checking vLLM"


def test_a_demo_workdir_that_cannot_be_made_is_refused_naming_it():
    done = kvstrata("demo", "--workdir", "/proc/nope")
    assert_one_line_refusal(done, "--workdir /proc/nope")
    assert done.stdout == ""


def test_a_demo_workdir_under_a_file_is_refused(tmp_path):
    (tmp_path / "file").write_text("")
    done = kvstrata("demo", "--workdir", str(tmp_path / "file" / "work"))
    assert_one_line_refusal(done, "is not a directory")


def test_an_unknown_sidecar_flag_is_answered_by_the_sidecar_command():
    done = kvstrata("sidecar", "--l1-sise", "2Gi")
    assert_one_line_refusal(done, "kvstrata sidecar:", "--l1-sise")


def test_a_bad_size_in_the_sidecar_config_is_one_line_quoting_the_value_once(tmp_path):
    config = tmp_path / "sidecar.yaml"
    config.write_text("l1:\n  size_bytes: 8GB\n")
    done = kvstrata("sidecar", "--config", str(config))
    assert_one_line_refusal(done, "l1.size_bytes", "'8GB'")
    assert done.stderr.count("got") == 1


def test_a_misspelt_sidecar_config_key_gets_the_key_it_was_probably_meant_to_be(tmp_path):
    config = tmp_path / "sidecar.yaml"
    config.write_text("l1:\n  sise_bytes: 1Gi\n")
    done = kvstrata("sidecar", "--config", str(config))
    assert_one_line_refusal(done, "l1.sise_bytes", "did you mean l1.size_bytes?")


def test_the_operator_with_a_malformed_kubeconfig_names_the_file(tmp_path):
    kubeconfig = tmp_path / "config"
    kubeconfig.write_text("apiVersion: v1\nclusters: [\n")
    done = kvstrata("operator", "--webhook-port", "0", env={"KUBECONFIG": str(kubeconfig)})
    assert_one_line_refusal(done, "kvstrata operator:", str(kubeconfig), "unusable")


def test_the_operator_with_a_kubeconfig_of_the_wrong_shape_names_the_file(tmp_path):
    kubeconfig = tmp_path / "config"
    kubeconfig.write_text("- just\n- a list\n")
    done = kvstrata("operator", "--webhook-port", "0", env={"KUBECONFIG": str(kubeconfig)})
    assert_one_line_refusal(done, "kvstrata operator:", str(kubeconfig))


def test_a_port_from_the_environment_that_is_no_number_is_one_line():
    done = kvstrata("operator", env={"KVSTRATA_OPERATOR_METRICS_PORT": "nine"})
    assert_one_line_refusal(done, "--metrics-port", "'nine'")


# -- the fuzz ---------------------------------------------------------------

_PARSER, _PARSERS = cli.build_parser()
FLAGS = {
    name: sorted(
        {opt for action in parser._actions for opt in action.option_strings} - {"-h", "--help"}
    )
    for name, parser in _PARSERS.items()
}
SAMPLED = [
    *("0", "-1", "1", "3", "99999", "8GB", "2Gi", "nan", "none", "valkey", "gpu", "soak"),
    *("serve", "seed=1", "regimes=l9", "=", "/proc/nope", "/dev/null", "/etc/hostname"),
    *("", " ", "x" * 300, "\N{SNOWMAN}"),
]
VALUES = st.one_of(
    st.sampled_from(SAMPLED),
    st.text(max_size=12).filter(lambda t: "\x00" not in t),
    st.integers(-(2**70), 2**70).map(str),
)


@st.composite
def command_lines(draw: st.DrawFn) -> list[str]:
    command = draw(st.sampled_from([*FLAGS, "nosuch", ""]))
    argv = [command] if command else []
    flags = FLAGS.get(command, ["--version", "--bogus"])
    for _ in range(draw(st.integers(0, 5))):
        token = draw(st.one_of(st.sampled_from([*flags, "--bogus", "-x"]), VALUES))
        argv.append(token)
        if token.startswith("-") and draw(st.booleans()):
            argv.append(draw(VALUES))
    return argv


@pytest.fixture(scope="module", autouse=True)
def _in_a_scratch_directory(tmp_path_factory):
    """Whatever the fuzz names as a path is looked up in an empty directory."""
    before = Path.cwd()
    os.chdir(tmp_path_factory.mktemp("fuzz"))
    yield
    os.chdir(before)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(argv=command_lines())
def test_no_command_line_ends_in_a_traceback(argv):
    err, out = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            cli.parse(argv)
    except SystemExit as exc:
        if exc.code == 0:  # --help, --version
            assert out.getvalue()
            return
        assert exc.code == 2, (argv, exc.code)
        lines = err.getvalue().splitlines() or out.getvalue().splitlines()
        if not err.getvalue():  # `kvstrata` with no command prints the help
            assert argv == [] or argv[0] == ""
            return
        assert len(lines) == 1, (argv, err.getvalue())
        assert lines[0].startswith("kvstrata"), lines


def test_a_misspelt_section_in_a_sidecar_environment_variable_is_refused_not_ignored():
    done = kvstrata("sidecar", env={"KVSTRATA_SHARDE__BACKEND": "valkey"})
    assert_one_line_refusal(done, "sharde", "did you mean shared?")
