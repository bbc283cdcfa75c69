"""The sidecar config loader: defaults, YAML, environment, refusals."""

from __future__ import annotations

import pytest

from kvstrata.sidecar.config import (
    ConfigError,
    config_from_dict,
    dump_config,
    load_config,
    parse_quantity,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (512, 512),
        ("512", 512),
        ("4Gi", 4 << 30),
        ("512Mi", 512 << 20),
        ("1G", 10**9),
        ("500k", 500_000),
        ("1.5Ki", 1536),
        (" 2Ti ", 2 << 40),
    ],
)
def test_quantities_parse_to_bytes(text, expected):
    assert parse_quantity(text) == expected


@pytest.mark.parametrize("bad", ["4GB", "-1", "lots", True, -5, ""])
def test_bad_quantities_are_refused(bad):
    with pytest.raises(ValueError):
        parse_quantity(bad)


def test_defaults_load_without_a_file():
    config = load_config(env={})
    assert config.l1.policy == "lru"
    assert config.l2.enabled
    assert config.shared.backend == "none"


def test_yaml_file_then_environment_override(tmp_path):
    path = tmp_path / "sidecar.yaml"
    path.write_text("l1:\n  size_bytes: 2Gi\n  policy: lfu\nl2:\n  size_bytes: 10Gi\n")
    env = {
        "KVSTRATA_L1__POLICY": "s3fifo",
        "KVSTRATA_L2__ENABLED": "false",
        "KVSTRATA_SHARED__VALKEY__POOL_SIZE": "3",
        "KVSTRATA_CONFIG_UNRELATED": "ignored",
    }
    config = load_config(path, env=env)
    assert config.l1.size_bytes == 2 << 30
    assert config.l1.policy == "s3fifo"
    assert config.l2.size_bytes == 10 << 30
    assert config.l2.enabled is False
    assert config.shared.valkey.pool_size == 3


def test_kvstrata_config_names_the_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("chunk_size: 512\n")
    assert load_config(env={"KVSTRATA_CONFIG": str(path)}).chunk_size == 512


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"l1": {"policy": "mru"}}, "l1.policy"),
        ({"l1": {"size_bytes": "12 parsecs"}}, "l1.size_bytes"),
        ({"l1": {"size_bytes": 1000}}, "l1.size_bytes"),
        ({"l2": {"sizebytes": "1Gi"}}, "l2.sizebytes"),
        ({"l2": {"writer_threads": 0}}, "l2.writer_threads"),
        ({"shared": {"admission": "some"}}, "shared.admission"),
        ({"server": {"http_port": 70000}}, "server.http_port"),
    ],
)
def test_bad_config_is_refused_naming_the_field(data, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        config_from_dict(data)


def test_bad_environment_value_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match=r"l1\.policy"):
        load_config(env={"KVSTRATA_L1__POLICY": "random"})


def test_unreadable_or_non_mapping_file_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml", env={})
    bad = tmp_path / "list.yaml"
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(bad, env={})


def test_dump_then_load_round_trips(tmp_path):
    config = config_from_dict({"l1": {"size_bytes": "64Mi", "prefix_aware": False}})
    path = tmp_path / "out.yaml"
    path.write_text(dump_config(config))
    assert load_config(path, env={}) == config
