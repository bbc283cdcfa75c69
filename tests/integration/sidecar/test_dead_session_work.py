"""A request still running for a client that died stops taking leases.

A real client process asks for thousands of chunks that live only in L2
(each one a promotion from disk), and is SIGKILLed while the sidecar works
on it. Its liveness connection closes with it; the sidecar ends the
session, and every lease of it is gone again without waiting for the lease
timeout (an hour here, so only the fix can release them)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import msgpack

CHUNKS = 4096
NBYTES = 2048
BATCH = 512

# The client: a session, its liveness connection, one PREPARE_RETRIEVE of
# every key sent without waiting for the reply, then nothing until killed.
CHILD = textwrap.dedent(
    """
    import sys
    import msgpack
    from kvstrata.sidecar import liveness, protocol as p
    from kvstrata.testing.rawpeer import RawPeer

    with open(sys.argv[1], "rb") as f:
        endpoint, fingerprint, keys = msgpack.unpackb(f.read())
    peer = RawPeer(endpoint)
    session = peer.hello(fingerprint, client_id="doomed")
    live = liveness.connect(liveness.liveness_path(endpoint[len("ipc://"):]), session)
    assert live is not None
    peer.send_request(p.PREPARE_RETRIEVE, {"keys": keys, "owner": "r"}, request_id=9)
    print("sent", flush=True)
    sys.stdin.read()  # until killed
    """
)


def _leases(sidecar: Any) -> int:
    return int(sidecar.status()["leases_active"])


def test_a_client_killed_mid_retrieve_leaves_no_lease_behind(
    sidecar_factory: Any, kit: Any, tmp_path: Path
):
    overrides = {"server": {"lease_seconds": 3600.0}, "l2": {"write_queue_depth": CHUNKS}}
    sidecar = sidecar_factory(overrides=overrides).start()
    keys = kit.make_keys(CHUNKS, seed=2620)
    writer = sidecar.client(call_timeout_s=10.0)
    for start in range(0, CHUNKS, BATCH):
        assert kit.store(writer, keys[start : start + BATCH], NBYTES, owner=f"w{start}") == BATCH
    kit.wait_until(
        lambda: sidecar.status()["tiers"]["l2"]["objects"] >= CHUNKS, 60, "the L2 write-behind"
    )
    writer.close()
    sidecar.restart()  # L1 is empty now: every chunk lives only in L2
    assert sidecar.status()["tiers"]["l1"]["objects"] == 0

    request = tmp_path / "request.msgpack"
    request.write_bytes(
        msgpack.packb([sidecar.endpoint, kit.NAMESPACE.fingerprint(), list(map(bytes, keys))])
    )
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(request)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline() == b"sent\n"
        # The sidecar is working on the request: it holds some of its leases.
        kit.wait_until(lambda: _leases(sidecar) > 0, 30, "the retrieve taking leases")
    finally:
        child.kill()
        child.wait()
    # The session ends through the liveness socket; the request still running
    # for it takes no more leases, and those it took are released. On 4edd4cb
    # the request went on acquiring for the dead session, and those leases
    # stayed until lease_seconds.
    kit.wait_until(lambda: sidecar.status()["clients_connected"] == 0, 30, "the session ended")
    kit.wait_until(lambda: _leases(sidecar) == 0, 60, "every lease of the dead client released")
    # The sidecar serves the next client as before.
    client = sidecar.client()
    assert kit.retrieve(client, keys[:4], owner="r") == [kit.payload(k, NBYTES) for k in keys[:4]]
    client.close()
