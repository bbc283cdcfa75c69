"""The sidecar's ZeroMQ endpoint: its default, its checks, and what an
``ipc://`` endpoint names on disk.

Why one module: the sidecar binds the endpoint and the connector connects
to it; both must agree on the default and on what an ``ipc://`` endpoint
means. Forms accepted:

``ipc://PATH``     a Unix socket file at PATH (the sidecar creates it 0660,
                   and ``PATH.live`` beside it for the liveness connection)
``ipc://@NAME``    a Linux abstract socket: no file, so no file mode and no
                   liveness connection (an ended client is reaped by the
                   idle timeout); whether it is bound is read from
                   ``/proc/net/unix``
``tcp://HOST:PORT`` a TCP port; off loopback it needs CURVE keys
"""

from __future__ import annotations

import ipaddress
import os
import tempfile

IPC = "ipc://"
TCP = "tcp://"


def default_endpoint() -> str:
    """``ipc://$TMPDIR/kvstrata/sidecar.sock``: what both sides use when none is set
    (read at call time, so that a changed ``TMPDIR`` is honoured)."""
    return f"{IPC}{tempfile.gettempdir()}/kvstrata/sidecar.sock"


def check_endpoint(value: str) -> str:
    """A ZeroMQ endpoint the sidecar can bind: ``ipc://PATH``, ``ipc://@NAME`` or
    ``tcp://HOST:PORT``; ValueError names what is wrong.

    Refused here rather than by ZeroMQ, which binds a random port for an
    out-of-range one and reports other mistakes as a bare errno.
    """
    scheme, sep, rest = value.partition("://")
    if not sep or scheme not in ("ipc", "tcp"):
        raise ValueError(f"{value!r} is not ipc://PATH or tcp://HOST:PORT")
    if scheme == "ipc":
        if not rest or rest == "@":
            raise ValueError(f"{value!r} names no socket path")
        return value
    host, colon, port = rest.rpartition(":")
    if not colon or not host:
        raise ValueError(f"{value!r} names no host and port (tcp://HOST:PORT)")
    if port != "*" and not (port.isdigit() and 0 <= int(port) <= 65535):
        raise ValueError(f"{value!r}: port {port!r} is not 0..65535 (or *)")
    return value


def is_abstract(endpoint: str) -> bool:
    """True for ``ipc://@NAME`` (a Linux abstract socket, which has no file)."""
    return endpoint.startswith(IPC + "@")


def ipc_path(endpoint: str) -> str | None:
    """The socket file of an ``ipc://PATH`` endpoint; None for tcp and for
    abstract sockets, which have none."""
    if not endpoint.startswith(IPC) or is_abstract(endpoint):
        return None
    return endpoint[len(IPC) :]


def listening(endpoint: str) -> bool | None:
    """Whether something is bound at an ``ipc://`` endpoint: its socket file
    exists, or (abstract) the kernel lists the name in ``/proc/net/unix``;
    None when this cannot be told (tcp, or no ``/proc``).

    The connector asks before its first send so that a vLLM step does not
    wait out a deadline for a sidecar that is not there.
    """
    path = ipc_path(endpoint)
    if path is not None:
        return os.path.exists(path)
    if not is_abstract(endpoint):
        return None
    # proc(5), /proc/net/unix: the last column is the bound path, an abstract
    # name shown with a leading "@".
    name = endpoint[len(IPC) :]
    try:
        with open("/proc/net/unix", encoding="utf-8", errors="replace") as table:
            return any(line.rstrip("\n").endswith(" " + name) for line in table)
    except OSError:
        return None


def endpoint_is_local(endpoint: str) -> bool:
    """True for ``ipc://`` (either form) and for ``tcp://`` on a loopback address."""
    if not endpoint.startswith(TCP):
        return True
    host = endpoint[len(TCP) :].rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a wildcard, an interface name or a host name
