"""The private parts of redis-py, botocore and urllib3 the shared tiers lean on
are still where the tiers read them; each failure names the attribute.

Why: ``pyproject.toml`` pins these libraries below the next release whose
source nobody has read (see the comment there). When a pin is raised, this
file says at once which internal moved, instead of a tier that quietly
slows down (S3: the body is read through the public ``read`` again) or
fails every GET (Valkey). What each module relies on, and why, is in its
docstring: ``sidecar/tiers/valkey_client.py`` (the command packer),
``sidecar/tiers/valkey_get.py`` (the socket and the error parser) and
``sidecar/tiers/s3body.py`` (the body's raw streams).
"""

from __future__ import annotations

import http.client
import importlib
import importlib.metadata
import inspect
import socket
import time
from collections.abc import Iterator
from typing import Any

import botocore
import botocore.response
import pytest
import redis
import redis.connection
import redis.exceptions
import tomllib
import urllib3
import urllib3.response
from packaging.requirements import Requirement

from kvstrata.refdocs import REPO
from kvstrata.sidecar.tiers import valkey_client
from kvstrata.sidecar.tiers.s3body import BodyStream

PINNED = ("redis", "botocore", "urllib3")  # the libraries whose internals the tiers read


def internal(owner: Any, name: str, library: str, user: str) -> Any:
    """``owner.name``, or a failure naming the attribute, the library's version
    and the module of ours that reads it."""
    if not hasattr(owner, name):
        where = getattr(owner, "__name__", type(owner).__name__)
        pytest.fail(
            f"{library} has no {where}.{name} any more: {user} reads it; "
            "re-read that module against this version before raising its pin in pyproject.toml"
        )
    return getattr(owner, name)


REDIS = f"redis-py {redis.__version__}"
BOTOCORE = f"botocore {botocore.__version__}"
URLLIB3 = f"urllib3 {urllib3.__version__}"


def _requirements() -> dict[str, Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return {r.name: r for r in map(Requirement, project["dependencies"])}


@pytest.mark.parametrize("name", PINNED)
def test_each_library_read_under_the_hood_has_an_upper_bound_the_installed_one_meets(
    name: str,
) -> None:
    requirement = _requirements().get(name)
    assert requirement is not None, f"pyproject.toml names no {name} requirement"
    assert any(spec.operator == "<" for spec in requirement.specifier), (
        f"{requirement}: no upper bound (its internals are read; see the comment there)"
    )
    installed = importlib.metadata.version(name)
    assert requirement.specifier.contains(installed), (
        f"{name} {installed} is installed, outside {requirement}: the checks below ran "
        "against an untested release"
    )


@pytest.fixture
def connection() -> Iterator[valkey_client._ScatterConnection]:
    """The tier's connection class, not connected (nothing here needs a server)."""
    conn = valkey_client._ScatterConnection(host="127.0.0.1", port=6379)
    yield conn
    conn.disconnect()


def test_redis_py_still_has_its_error_parser_where_valkey_get_imports_it() -> None:
    try:
        parsers = importlib.import_module("redis._parsers")
    except ImportError as exc:
        pytest.fail(f"{REDIS} has no module redis._parsers ({exc}): valkey_get.py imports it")
    parser = internal(parsers, "BaseParser", REDIS, "sidecar/tiers/valkey_get.py")
    parse_error = internal(parser, "parse_error", REDIS, "sidecar/tiers/valkey_get.py")
    error = parse_error("WRONGTYPE Operation against a key holding the wrong kind of value")
    assert isinstance(error, redis.exceptions.ResponseError)
    assert "WRONGTYPE" in str(error)


def test_redis_py_connections_still_hold_their_socket_as_sock(
    connection: valkey_client._ScatterConnection,
) -> None:
    """valkey_get reads replies off ``AbstractConnection._sock`` (None until connected)."""
    assert internal(connection, "_sock", REDIS, "sidecar/tiers/valkey_get.py") is None
    connect = inspect.getsource(
        internal(
            redis.connection.AbstractConnection,
            "connect_check_health",
            REDIS,
            "this test, to see where _sock is set",
        )
    )
    assert "self._sock = sock" in connect, (
        f"{REDIS}: AbstractConnection.connect_check_health no longer sets self._sock; "
        "sidecar/tiers/valkey_get.py reads replies from it"
    )


def test_redis_py_still_builds_its_command_packer_through_the_hook_valkey_overrides(
    connection: valkey_client._ScatterConnection,
) -> None:
    """The tier's packer is in use only while redis-py asks
    ``_construct_command_packer`` for one: a Scatter argument then stays one
    item (redis-py's own packer would refuse it as a value it cannot encode)."""
    internal(
        redis.connection.AbstractConnection,
        "_construct_command_packer",
        REDIS,
        "sidecar/tiers/valkey_client.py (_ScatterSending)",
    )
    cutoff = internal(connection, "_buffer_cutoff", REDIS, "sidecar/tiers/valkey_client.py")
    assert isinstance(cutoff, int) and cutoff > 0
    value = valkey_client.Scatter([b"x" * (cutoff + 1)])
    unused = f"{REDIS} no longer builds its packer with _construct_command_packer"
    try:
        packed = connection.pack_command("SET", b"key", value)
    except redis.exceptions.DataError:
        pytest.fail(f"{unused}: its own packer refused the Scatter argument")
    assert value in packed, unused


def test_redis_py_send_packed_command_still_takes_check_health() -> None:
    params = inspect.signature(redis.connection.AbstractConnection.send_packed_command).parameters
    assert list(params)[:3] == ["self", "command", "check_health"], (
        f"{REDIS}: send_packed_command{list(params)}; sidecar/tiers/valkey_client.py overrides it"
    )


def _http_response(body: bytes) -> tuple[http.client.HTTPResponse, socket.socket]:
    """http.client's response to a Content-Length GET, read from a real socket pair."""
    ours, theirs = socket.socketpair()
    theirs.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    response = http.client.HTTPResponse(ours, method="GET")
    response.begin()
    ours.close()  # the response holds its own file on the socket
    return response, theirs


def test_botocore_and_urllib3_still_lead_to_http_clients_response_for_a_zero_copy_read() -> None:
    """StreamingBody._raw_stream is urllib3's response, whose _fp is http.client's:
    the S3 tier reads a body through them straight into its buffer."""
    payload = b"kvstrata " * 100
    fp, peer = _http_response(payload)
    try:
        raw = urllib3.response.HTTPResponse(
            body=fp, preload_content=False, decode_content=False, status=200
        )
        body = botocore.response.StreamingBody(raw, len(payload))
        raw_stream = internal(body, "_raw_stream", BOTOCORE, "sidecar/tiers/s3body.py")
        assert raw_stream is raw
        assert internal(raw_stream, "_fp", URLLIB3, "sidecar/tiers/s3body.py") is fp
        internal(raw_stream, "release_conn", URLLIB3, "sidecar/tiers/s3body.py")

        stream = BodyStream({"Body": body, "ContentLength": len(payload)}, time.monotonic() + 60)
        assert stream.zero_copy, "the S3 tier fell back to StreamingBody.read"
        out = bytearray(len(payload))
        stream.fill(memoryview(out))
        stream.finish()
        assert bytes(out) == payload
        assert fp.isclosed()  # http.client saw the last byte of the Content-Length body
    finally:
        peer.close()
        fp.close()
