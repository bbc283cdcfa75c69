"""The transfer mode is read once at each boundary into an enum, and an unknown
one is refused there with a message naming it (kvstrata.sidecar.transfer_mode)."""

from __future__ import annotations

import msgpack
import pytest

from kvstrata.sidecar import protocol as p
from kvstrata.sidecar.config import ConfigError, config_from_dict
from kvstrata.sidecar.transfer_mode import ModeSetting, TransferMode, UnknownMode, parse

FINGERPRINT = b"f" * 16


def _hello_body(mode: object) -> dict:
    return {"client_id": "c", "role": "worker", "fingerprint": FINGERPRINT, "transfer_mode": mode}


def test_a_mode_string_parses_into_its_member() -> None:
    assert parse(TransferMode, "ipc", "where") is TransferMode.IPC
    assert parse(ModeSetting, "auto", "where") is ModeSetting.AUTO


def test_an_unknown_mode_is_refused_naming_the_value_the_place_and_the_known_modes() -> None:
    with pytest.raises(UnknownMode) as caught:
        parse(ModeSetting, "carrier-pigeon", "kv_connector_extra_config.transfer_mode")
    message = str(caught.value)
    assert "'carrier-pigeon'" in message
    assert "kv_connector_extra_config.transfer_mode" in message
    assert "auto, ipc, host" in message


def test_a_hello_asking_for_an_unknown_mode_is_refused_as_unsupported_naming_it() -> None:
    with pytest.raises(p.ProtocolError) as caught:
        p.HelloRequest.from_wire(_hello_body("rdma"))
    assert caught.value.code == p.E_UNSUPPORTED
    assert "'rdma'" in str(caught.value) and "transfer_mode" in str(caught.value)


def test_a_hello_whose_mode_is_not_a_string_is_a_bad_request() -> None:
    with pytest.raises(p.ProtocolError) as caught:
        p.HelloRequest.from_wire(_hello_body(7))
    assert caught.value.code == p.E_BAD_REQUEST


def test_the_mode_travels_as_its_string_and_comes_back_as_the_member() -> None:
    """The wire is unchanged: msgpack carries "ipc", the reader gets TransferMode.IPC."""
    hello = p.HelloRequest(
        client_id="c", role="worker", fingerprint=FINGERPRINT, transfer_mode=TransferMode.IPC
    )
    wire = msgpack.unpackb(msgpack.packb(hello.to_wire()))
    assert wire["transfer_mode"] == "ipc"
    assert p.HelloRequest.from_wire(wire).transfer_mode is TransferMode.IPC
    reply = p.HelloReply(session_id="s", transfer_mode=TransferMode.HOST)
    assert msgpack.unpackb(msgpack.packb(reply.to_wire()))["transfer_mode"] == "host"


def test_the_sidecar_config_holds_a_member_and_dumps_its_string() -> None:
    config = config_from_dict({"transfer_mode": "ipc"})
    assert config.transfer_mode is ModeSetting.IPC
    assert config.model_dump(mode="json")["transfer_mode"] == "ipc"
    with pytest.raises(ConfigError, match="transfer_mode"):
        config_from_dict({"transfer_mode": "carrier-pigeon"})


def test_only_the_host_setting_rules_out_ipc() -> None:
    assert [s for s in ModeSetting if not s.may_use_ipc] == [ModeSetting.HOST]
