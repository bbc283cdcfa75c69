"""Only the vLLM a sidecar serves may open a session: the uid of a HELLO's
process, as the kernel reports it on the ipc:// socket, must be the first
client's (default) or one listed in ``server.client_uids``.

The foreign client is a real process running as another uid (``nobody``),
which needs root to start; the sidecar and the admitted client run as us.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstrata.sidecar import protocol as p
from kvstrata.sidecar.keys import Namespace
from kvstrata.sidecar.peers import PeerCredentials, credentials_from_peer_address

FOREIGN_UID = 65534  # nobody
NBYTES = 4096
NAMESPACE = Namespace(model="kvstrata-test-model", block_size=16, chunk_size=16)  # conftest's

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root to run a client process as another uid"
)

# A process that says HELLO as FOREIGN_UID and prints the reply's kind and code.
_FOREIGN_HELLO = """
import json, os, sys
import zmq
from kvstrata.sidecar import protocol as p
from kvstrata.sidecar.transfer_mode import TransferMode
endpoint, gid, uid, fingerprint = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
os.setgroups([]); os.setgid(gid); os.setuid(uid)
ctx = zmq.Context(); sock = ctx.socket(zmq.DEALER); sock.setsockopt(zmq.LINGER, 0)
sock.connect(endpoint)
hello = p.HelloRequest(client_id="intruder", role="worker", fingerprint=bytes.fromhex(fingerprint),
                       namespace={}, transfer_mode=TransferMode.HOST, pid=os.getpid())
sock.send(p.encode_request(p.HELLO, 1, "", hello))
if not sock.poll(5000):
    print(json.dumps({"reply": None})); sys.exit(0)
reply = p.decode_reply(sock.recv_multipart(), p.HELLO).body
print(json.dumps({"reply": type(reply).__name__, "code": getattr(reply, "code", None),
                  "message": getattr(reply, "message", None)}))
"""


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A socket directory another uid can reach (pytest's own tmp is 0700)."""
    made = Path(tempfile.mkdtemp(prefix="kvstrata-admission-"))
    made.chmod(0o755)
    yield made
    shutil.rmtree(made, ignore_errors=True)


@pytest.fixture
def start_sidecar(open_dir: Path, kit: Any) -> Iterator[Any]:
    started: list[Any] = []

    def start(server: dict[str, Any] | None = None) -> Any:
        # The socket's group is the foreign process's, so the file mode lets it
        # in and only the uid check can keep it out.
        overrides = {"server": {"socket_group": str(FOREIGN_UID), **(server or {})}}
        sidecar = kit.Sidecar(open_dir / f"sc{len(started)}", overrides)
        (open_dir / f"sc{len(started)}").chmod(0o755)
        started.append(sidecar)
        return sidecar.start()

    yield start
    for sidecar in started:
        sidecar.cleanup()


def _foreign_hello(sidecar: Any) -> dict[str, Any]:
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            _FOREIGN_HELLO,
            sidecar.endpoint,
            str(FOREIGN_UID),
            str(FOREIGN_UID),
            NAMESPACE.fingerprint().hex(),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def _forbidden_total(sidecar: Any) -> float:
    for line in sidecar.get("/metrics").splitlines():
        if line.startswith('kvstrata_errors_total{kind="forbidden"}'):
            return float(line.split()[-1])
    raise AssertionError("kvstrata_errors_total{kind=forbidden} is not served")


def test_a_process_of_another_uid_cannot_say_hello_and_the_first_client_is_still_served(
    start_sidecar: Any, kit: Any
):
    sidecar = start_sidecar()
    tenant = sidecar.client()
    keys = kit.make_keys(2, seed=900)
    assert kit.store(tenant, keys, NBYTES, owner="w") == 2  # the first client: our uid

    answer = _foreign_hello(sidecar)
    assert answer["reply"] == "ErrorReply", answer
    assert answer["code"] == p.E_FORBIDDEN
    assert f"uid {FOREIGN_UID}" in answer["message"] and "server.client_uids" in answer["message"]
    assert _forbidden_total(sidecar) == 1
    assert "refused HELLO from uid 65534" in sidecar.log()

    # The admitted client keeps its session and its chunks.
    assert kit.retrieve(tenant, keys, owner="r") == [kit.payload(k, NBYTES) for k in keys]
    tenant.close()
    other = sidecar.client()  # another process of the admitted uid is the same client
    assert kit.retrieve(other, keys, owner="r2") == [kit.payload(k, NBYTES) for k in keys]
    other.close()


def test_the_first_hello_fixes_the_uid_even_when_it_is_the_foreign_one(start_sidecar: Any):
    sidecar = start_sidecar()
    assert _foreign_hello(sidecar)["reply"] == "HelloReply"
    refused = sidecar.client()
    assert refused.lookup([NAMESPACE.fingerprint() + bytes(32)], prefetch=False, owner="x") is None
    assert refused.errors.get(p.E_FORBIDDEN) == 1
    refused.close()
    assert _forbidden_total(sidecar) == 1


def test_uids_listed_in_client_uids_are_all_admitted(start_sidecar: Any, kit: Any):
    sidecar = start_sidecar({"client_uids": [os.geteuid(), FOREIGN_UID]})
    tenant = sidecar.client()
    assert kit.store(tenant, kit.make_keys(1, seed=901), NBYTES, owner="w") == 1
    assert _foreign_hello(sidecar)["reply"] == "HelloReply"
    assert _forbidden_total(sidecar) == 0
    tenant.close()


def test_a_list_without_our_uid_refuses_us(start_sidecar: Any):
    sidecar = start_sidecar({"client_uids": [FOREIGN_UID]})
    client = sidecar.client()
    assert client.lookup([NAMESPACE.fingerprint() + bytes(32)], prefetch=False, owner="x") is None
    assert client.errors.get(p.E_FORBIDDEN) == 1
    client.close()
    assert _foreign_hello(sidecar)["reply"] == "HelloReply"


def test_peer_addresses_are_parsed_from_libzmqs_ipc_suffix_only():
    creds = credentials_from_peer_address("localhost:1000:1001:4242")
    assert creds == PeerCredentials(uid=1000, gid=1001, pid=4242)
    assert credentials_from_peer_address("127.0.0.1") is None  # tcp: no credentials
    assert credentials_from_peer_address("") is None
    assert credentials_from_peer_address(None) is None
    assert credentials_from_peer_address("x:a:b:c") is None
