"""``docs/connector.md``: the connector's ``kv_connector_extra_config`` keys, from
:data:`kvstrata.connector.settings.EXTRA_CONFIG_KEYS`."""

from __future__ import annotations

from kvstrata.connector.settings import EXTRA_CONFIG_KEYS
from kvstrata.connector.transfer_config import CONNECTOR_CLASS, CONNECTOR_MODULE
from kvstrata.refdocs.markdown import GENERATED, table


def render() -> str:
    lines = [
        "# Connector configuration",
        "",
        GENERATED.format(source="`kvstrata.connector.settings.EXTRA_CONFIG_KEYS`"),
        "",
        f"vLLM loads the connector with `kv_connector: {CONNECTOR_CLASS}` and",
        f"`kv_connector_module_path: {CONNECTOR_MODULE}` in `--kv-transfer-config`;",
        "these are the keys of its `kv_connector_extra_config`. A key not listed here",
        "stops vLLM at start with an error naming it and the keys below.",
        "",
        *table(
            ("key", "default", "meaning"),
            [(f"`{k.name}`", k.default, k.description) for k in EXTRA_CONFIG_KEYS],
        ),
    ]
    return "\n".join(lines) + "\n"
