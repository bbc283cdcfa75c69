"""Tenants are separated by the server, not by convention: keys are checked
against the session's namespace, a session belongs to the socket that opened
it, session ids are never published, and the socket files are the door."""

from __future__ import annotations

import grp
import json
import os
import stat
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from kvstrata.connector.client import SidecarClient
from kvstrata.sidecar import protocol as p
from kvstrata.sidecar.keys import Namespace
from kvstrata.sidecar.transfer_mode import TransferMode

NBYTES = 4096
OTHER_TENANT = Namespace(model="another-tenant", block_size=16, chunk_size=16)


class Peer:
    """A raw DEALER socket: a process speaking the protocol by hand."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def ask(self, op: str, session_id: str, body: p.Message) -> p.Reply:
        self.sock.send(p.encode_request(op, 1, session_id, body))
        assert self.sock.poll(5000), f"no reply to {op}"
        return p.decode_reply(self.sock.recv_multipart(), op)

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture
def peer(sidecar: Any) -> Iterator[Peer]:
    made = Peer(sidecar.endpoint)
    yield made
    made.close()


def _errors(sidecar: Any, kind: str) -> float:
    for line in sidecar.get("/metrics").splitlines():
        if line.startswith(f'kvstrata_errors_total{{kind="{kind}"}}'):
            return float(line.split()[-1])
    return 0.0


def test_a_client_of_another_namespace_can_neither_read_nor_overwrite_a_tenants_chunk(
    sidecar: Any, kit: Any
):
    tenant = sidecar.client()
    keys = kit.make_keys(3, seed=400)
    assert kit.store(tenant, keys, NBYTES, owner="w") == 3
    intruder = SidecarClient(sidecar.endpoint, OTHER_TENANT, role="worker", call_timeout_s=2)
    assert intruder.prepare_retrieve(keys, "steal") is None
    assert intruder.prepare_store(keys, NBYTES, "uint8", (NBYTES,), "overwrite") is None
    assert intruder.lookup(keys, prefetch=True, owner="probe") is None
    assert intruder.errors.get(p.E_BAD_REQUEST) == 3
    assert _errors(sidecar, p.E_BAD_REQUEST) >= 3
    assert kit.retrieve(tenant, keys, owner="r") == [kit.payload(k, NBYTES) for k in keys]
    tenant.close()
    intruder.close()


def test_a_session_id_named_from_another_socket_is_refused(sidecar: Any, kit: Any, peer: Peer):
    victim = sidecar.client()
    keys = kit.make_keys(2, seed=410)
    kit.store(victim, keys, NBYTES, owner="w")
    held = victim.prepare_retrieve(keys, "held")
    assert held is not None and all(held)
    stolen = victim._session_id  # however an attacker came by it
    reply = peer.ask(p.RELEASE, stolen, p.ReleaseRequest([s.lease_id for s in held if s]))
    assert not reply.ok and reply.body.code == p.E_NO_SESSION
    assert kit.client_leases(sidecar, victim) == 2
    victim.close()


def test_a_hello_copying_another_clients_id_role_and_pid_does_not_replace_its_session(
    sidecar: Any, kit: Any, peer: Peer
):
    victim = sidecar.client(client_id="victim")
    keys = kit.make_keys(2, seed=420)
    kit.store(victim, keys, NBYTES, owner="w")
    assert victim.prepare_retrieve(keys, "held") is not None
    epoch = victim.epoch
    hello = p.HelloRequest("victim", "worker", keys[0][:16], None, TransferMode.HOST, os.getpid())
    assert peer.ask(p.HELLO, "", hello).ok
    assert kit.client_leases(sidecar, victim) == 2
    assert victim.ping() and victim.epoch == epoch  # no re-HELLO was needed
    victim.close()


def test_status_never_shows_session_ids_and_lists_clients_only_when_asked(
    sidecar_factory: Any, kit: Any
):
    detailed = sidecar_factory("detailed").start()  # the test harness asks for detail
    quiet = sidecar_factory("quiet", {"server": {"status_detail": False}}).start()
    for sidecar in (detailed, quiet):
        client = sidecar.client()
        assert client.ping()
        text = sidecar.get("/status")
        assert client._session_id not in text
        assert "session_id" not in text
        status = json.loads(text)
        assert status["clients_connected"] == 1
        if sidecar is detailed:
            assert [c["role"] for c in status["clients"]] == ["worker"]
        else:
            assert "clients" not in status
        client.close()


def test_the_socket_files_are_0660_and_belong_to_the_configured_group(
    sidecar_factory: Any,
):
    group = grp.getgrall()[-1]  # any group other than ours will do
    sidecar = sidecar_factory(overrides={"server": {"socket_group": group.gr_name}}).start()
    path = sidecar.endpoint[len("ipc://") :]
    for name in (path, path + ".live"):
        st = os.stat(name)
        assert stat.S_ISSOCK(st.st_mode), name
        assert stat.S_IMODE(st.st_mode) == 0o660, f"{name}: {oct(st.st_mode)}"
        assert st.st_gid == group.gr_gid, name
