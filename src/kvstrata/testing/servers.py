"""Real servers on loopback for the remote-tier tests and benchmark.

Both ``tests/integration/remote/conftest.py`` and ``kvstrata bench remote``
start the same processes through this module, so the benchmark measures the
setup the tests check:

* :class:`RedisServer`: one ``valkey-server`` (or Debian's ``redis-server``,
  which speaks the same protocol) on a free loopback port, data in a
  directory the caller owns; it can be killed and restarted on the same port.
* :class:`RedisClusterServers`: three such servers with ``cluster-enabled
  yes``, joined with ``redis-cli --cluster create`` (no replicas).
* :class:`MotoS3Server`: moto's standalone S3 endpoint (``moto_server``) in a
  child process, so the client's GIL is not shared with the server's.
* :class:`AgeableMotoS3`: the same endpoint on a thread of the test's own
  process, so a test can make stored objects older (``age``): expiry and
  LRU are about days, and a test must not wait for them.

Readiness is polled with a deadline (:func:`wait_for`, the shared poller
:func:`kvstrata.testing.poll.wait_until` set up for server probes); nothing
sleeps a fixed time. Every process started here is stopped by ``stop()``, which the
context-manager exit calls too.
"""

from __future__ import annotations

import abc
import os
import random
import shutil
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import TypeVar

from kvstrata.testing.poll import wait_until

LOOPBACK = "127.0.0.1"

_M = TypeVar("_M", bound="_Managed")
_S = TypeVar("_S", bound="_ChildServer")


class ServerError(RuntimeError):
    """A server did not start or did not become ready in time."""


def free_port() -> int:
    """A TCP port on loopback nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((LOOPBACK, port))
        except OSError:
            return False
    return True


def free_cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free and valid too."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 40000)
        if _port_is_free(port) and _port_is_free(port + 10000):
            return port
    raise ServerError("no free port pair (port, port + 10000) on loopback")


def wait_for(condition: Callable[[], bool], timeout: float, what: str, step: float = 0.02) -> None:
    """:func:`~kvstrata.testing.poll.wait_until` for server probes: a probe that
    raises is "not yet" (the server is still coming up), :class:`ServerError`
    means gone for good and is what the deadline raises."""
    wait_until(condition, timeout, what, step=step, error=ServerError, retry_on=(Exception,))


def _valkey_or_redis(tool: str) -> str:
    """``valkey-{tool}`` when the machine has it, else Debian's ``redis-{tool}``."""
    for name in (f"valkey-{tool}", f"redis-{tool}"):
        path = shutil.which(name)
        if path:
            return path
    raise ServerError(f"neither valkey-{tool} nor redis-{tool} is on PATH (make system-deps)")


def redis_server_binary() -> str:
    """``valkey-server`` when the machine has it, else ``redis-server``."""
    return _valkey_or_redis("server")


def redis_cli_binary() -> str:
    """``valkey-cli`` when the machine has it, else ``redis-cli``."""
    return _valkey_or_redis("cli")


def _ping(port: int, password: str | None = None) -> bool:
    """One RESP PING over a raw socket (no client library involved)."""
    with socket.create_connection((LOOPBACK, port), timeout=0.5) as sock:
        if password is not None:
            sock.sendall(f"AUTH {password}\r\n".encode())
            if not sock.recv(64).startswith(b"+OK"):
                return False
        sock.sendall(b"PING\r\n")
        return sock.recv(64).startswith(b"+PONG")


class _Managed(abc.ABC):
    """Started on ``with`` entry and stopped on exit, even when the body raises."""

    @abc.abstractmethod
    def start(self: _M, timeout: float = 10.0) -> _M:
        """Start and wait until ready; :class:`ServerError` after ``timeout``."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Stop every process started; safe to call when not running."""

    def __enter__(self: _M) -> _M:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


class _ChildServer(_Managed):
    """A server in one child process: start, wait until it answers, kill.

    Subclasses say how to launch the process (:meth:`_command`) and how to
    tell it is ready (:meth:`_ready`); the lifecycle (restart on the same
    port, the readiness deadline, the kill that stands in for a crash) is
    shared so every server behaves alike in the tests.
    """

    what = "server"  # how errors name it
    poll_step = 0.02  # seconds between readiness probes

    def __init__(self, port: int) -> None:
        self.port = port
        self.process: subprocess.Popen[bytes] | None = None

    @abc.abstractmethod
    def _command(self) -> list[str]:
        """The argv of the child process (called just before it is launched)."""

    @abc.abstractmethod
    def _ready(self) -> bool:
        """One readiness probe; may raise while the server is not up yet."""

    def _exited_message(self) -> str:
        return f"{self.what} on port {self.port} exited"

    def start(self: _S, timeout: float = 10.0) -> _S:
        """Start (or restart, on the same port) and wait until :meth:`_ready`."""
        if self.process is not None and self.process.poll() is None:
            return self
        self.process = subprocess.Popen(
            self._command(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
        )
        try:
            wait_for(
                self._alive_and_ready,
                timeout,
                f"{self.what} on port {self.port}",
                step=self.poll_step,
            )
        except ServerError:
            self.stop()
            raise
        return self

    def _alive_and_ready(self) -> bool:
        if self.process is None or self.process.poll() is not None:
            raise ServerError(self._exited_message())
        return self._ready()

    def stop(self, timeout: float = 5.0) -> None:
        """Kill the process (SIGKILL: a crash, not a clean shutdown) and reap it."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=timeout)
        self.process = None


class RedisServer(_ChildServer):
    """One Redis-protocol server process on ``127.0.0.1:port``."""

    what = "redis"

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        port: int | None = None,
        cluster: bool = False,
        password: str | None = None,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        super().__init__(port or (free_cluster_port() if cluster else free_port()))
        self.data_dir = Path(data_dir)
        self.cluster = cluster
        self.password = password
        self.extra_args = extra_args

    @property
    def url(self) -> str:
        return f"redis://{LOOPBACK}:{self.port}/0"

    def _command(self) -> list[str]:
        """The server's argv; its data directory is made here, on each launch."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        args = [
            redis_server_binary(),
            "--bind", LOOPBACK,
            "--port", str(self.port),
            "--dir", str(self.data_dir),
            "--save", "",
            "--appendonly", "no",
            "--protected-mode", "no",
            "--maxmemory-policy", "noeviction",
            "--logfile", str(self.data_dir / "server.log"),
        ]  # fmt: skip
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
            args += ["--cluster-node-timeout", "2000"]
        if self.password is not None:
            args += ["--requirepass", self.password]
        return args + list(self.extra_args)

    def _ready(self) -> bool:
        """It answers PING (after AUTH when it has a password)."""
        return _ping(self.port, self.password)

    def _exited_message(self) -> str:
        return f"{super()._exited_message()}; see {self.data_dir}/server.log"


class RedisClusterServers(_Managed):
    """Three cluster-enabled servers joined into one cluster (no replicas)."""

    def __init__(self, data_dir: str | os.PathLike[str], nodes: int = 3) -> None:
        base = Path(data_dir)
        self.servers = [RedisServer(base / f"node{i}", cluster=True) for i in range(nodes)]

    @property
    def url(self) -> str:
        """A seed node; the cluster client discovers the others."""
        return self.servers[0].url

    def start(self, timeout: float = 20.0) -> RedisClusterServers:
        try:
            for server in self.servers:
                server.start()
            addrs = [f"{LOOPBACK}:{s.port}" for s in self.servers]
            create = ["--cluster", "create", *addrs, "--cluster-replicas", "0", "--cluster-yes"]
            subprocess.run(
                [redis_cli_binary(), *create],
                check=True,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                timeout=timeout,
            )
            wait_for(self.is_ok, timeout, "cluster_state:ok on every node")
        except (subprocess.SubprocessError, ServerError) as exc:
            self.stop()
            raise ServerError(f"cluster did not form: {exc}") from exc
        return self

    def is_ok(self) -> bool:
        """Every node reports ``cluster_state:ok``."""
        for server in self.servers:
            out = subprocess.run(
                [redis_cli_binary(), "-p", str(server.port), "cluster", "info"],
                capture_output=True,
                timeout=2,
                check=False,
            ).stdout
            if b"cluster_state:ok" not in out:
                return False
        return True

    def stop(self) -> None:
        for server in self.servers:
            server.stop()


class MotoS3Server(_ChildServer):
    """moto's standalone S3 HTTP endpoint in a child process.

    Its state lives in that process's memory: a restart starts empty.
    """

    what = "moto_server"
    poll_step = 0.05

    def __init__(self, port: int | None = None, memory_object_bytes: int | None = None) -> None:
        """``memory_object_bytes``: objects up to this size stay in the server's
        memory (``MOTO_S3_DEFAULT_KEY_BUFFER_SIZE``; moto's default writes any
        object above about 5 MiB to a temporary file)."""
        super().__init__(port or free_port())
        self.memory_object_bytes = memory_object_bytes

    @property
    def endpoint_url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def start(self: _S, timeout: float = 30.0) -> _S:
        """Start (or restart, on the same port) and wait until it answers HTTP."""
        return super().start(timeout)

    def _command(self) -> list[str]:
        code = (
            "import sys; from moto.server import main; "
            f"sys.exit(main(['-H', '{LOOPBACK}', '-p', '{self.port}']))"
        )
        if self.memory_object_bytes is not None:
            code = (
                "import os; "
                f"os.environ['MOTO_S3_DEFAULT_KEY_BUFFER_SIZE'] = '{self.memory_object_bytes}'; "
                + code
            )
        return [sys.executable, "-c", code]

    def _ready(self) -> bool:
        return _answers_http(self.endpoint_url)


def _answers_http(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/", timeout=1) as resp:
            return resp.status < 500
    except urllib.error.HTTPError as exc:  # any HTTP answer means it is up
        return exc.code < 500
    except OSError:
        return False


class AgeableMotoS3(_Managed):
    """moto's S3 endpoint served from a thread of this process.

    The objects it stores live in this process's moto backend, so
    :meth:`age` can move an object's ``LastModified`` into the past: the
    server's clock, as an object sees it, jumps ahead (what days of waiting
    would do). Everything else goes through its HTTP endpoint like any S3.
    Use it only where a test needs :meth:`age`; :class:`MotoS3Server`
    otherwise.
    """

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self._server: object | None = None

    @property
    def endpoint_url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def start(self, timeout: float = 30.0) -> AgeableMotoS3:
        import logging

        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
        server = ThreadedMotoServer(ip_address=LOOPBACK, port=self.port, verbose=False)
        server.start()
        self._server = server
        wait_for(lambda: _answers_http(self.endpoint_url), timeout, "in-process moto S3")
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()  # type: ignore[attr-defined]
            self._server = None

    def age(self, bucket: str, key: str, seconds: float) -> None:
        """Make the object ``key`` ``seconds`` older (its ``LastModified`` moves back)."""
        import datetime as dt

        from moto.core import DEFAULT_ACCOUNT_ID
        from moto.s3.models import s3_backends

        stored = s3_backends[DEFAULT_ACCOUNT_ID]["global"].get_object(bucket, key)
        if stored is None:
            raise KeyError(f"s3://{bucket}/{key} is not stored")
        stored.last_modified -= dt.timedelta(seconds=seconds)
