"""``kvstrata sidecar``: load the config, start engine, ZMQ server and HTTP, serve.

Why here and not in the server: this module owns the process (config
precedence, exit codes, signals, teardown order); the server module stays a
library that tests and benchmarks can embed.

Config precedence: embedded defaults < ``--config FILE`` (or
``$KVSTRATA_CONFIG``) < ``KVSTRATA_*`` environment < command-line flags.
Exit codes: 0 after SIGTERM/SIGINT, 2 for bad config (the message on stderr
names the field), 1 when the endpoint or port cannot be taken.

Top-level imports stay light (``kvstrata --help`` must answer at once); the
engine, ZeroMQ and prometheus are imported in :func:`run`.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvstrata.sidecar.acceptguard import GuardState
    from kvstrata.sidecar.config import SidecarConfig
    from kvstrata.sidecar.engine import StorageManager
    from kvstrata.sidecar.http import HttpEndpoints
    from kvstrata.sidecar.sealing import KeyRing
    from kvstrata.sidecar.server import SidecarServer
    from kvstrata.sidecar.tiers.base import Tier
    from kvstrata.sidecar.transfer.cuda_device import CudaDevices
    from kvstrata.sidecar.transfer.ipc import IpcTransfers

logger = logging.getLogger("kvstrata.sidecar")

GIL_SWITCH_S = 0.0005


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="sidecar YAML config (else defaults)")
    parser.add_argument("--endpoint", help="ZeroMQ endpoint, ipc://PATH or tcp://HOST:PORT")
    parser.add_argument("--http-port", type=int, help="port of /metrics /healthz /readyz /status")
    parser.add_argument("--l1-size", help="L1 arena size in bytes or a quantity like 2Gi")
    parser.add_argument("--l2-path", help="directory of the L2 disk tier")


def check_arguments(args: argparse.Namespace) -> str | None:
    """The config's problem as one line (None: it loads), before anything starts."""
    from kvstrata.sidecar.config import ConfigError

    try:
        load(args)
    except ConfigError as exc:
        return one_line(str(exc))
    return None


def one_line(message: str) -> str:
    """A loader's message (a heading, then one indented line per field) on one line."""
    head, *fields = message.splitlines()
    return f"{head} {'; '.join(f.strip() for f in fields)}" if fields else head


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if args.endpoint is not None:
        out.setdefault("server", {})["endpoint"] = args.endpoint
    if args.http_port is not None:
        out.setdefault("server", {})["http_port"] = args.http_port
    if args.l1_size is not None:
        out.setdefault("l1", {})["size_bytes"] = args.l1_size
    if args.l2_path is not None:
        out.setdefault("l2", {})["path"] = args.l2_path
    return out


def load(args: argparse.Namespace) -> SidecarConfig:
    """The effective config; raises ``ConfigError`` naming the bad field."""
    from kvstrata.sidecar.config import _merge, config_from_dict, load_config

    config = load_config(args.config)
    overrides = _overrides(args)
    if not overrides:
        return config
    merged = _merge(config.model_dump(mode="json"), overrides)
    return config_from_dict(merged, source="config + command line")


def _open_keys(config: SidecarConfig, stack: contextlib.ExitStack) -> KeyRing | None:
    """The encryption keys (None when encryption is off), watched for rotation."""
    if config.encryption.mode == "off":
        return None
    from kvstrata.sidecar.sealing import KeyFolderError, KeyRing, KeyWatcher

    try:
        keys = KeyRing(config.encryption.mode, config.encryption.key_dir)
    except (KeyFolderError, OSError) as exc:
        raise _StartError(str(exc), 2) from exc
    watcher = KeyWatcher(keys, config.encryption.reload_seconds)
    watcher.start()
    stack.callback(watcher.close)
    return keys


def run(args: argparse.Namespace) -> int:
    from kvstrata.sidecar.acceptguard import preload
    from kvstrata.sidecar.config import ConfigError

    # First, before any thread or descriptor: it re-executes the process once.
    guard = preload()
    try:
        config = load(args)
    except ConfigError as exc:
        print(f"kvstrata sidecar: {exc}", file=sys.stderr)
        return 2
    from kvstrata.sidecar.logs import configure_logging

    configure_logging(config.log_level, config.log_format)
    return _serve(config, guard)


class _StartError(Exception):
    """A start-up failure: the message for stderr and the process's exit code."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def _serve(config: SidecarConfig, guard: GuardState) -> int:
    """Start every part, serve until SIGTERM/SIGINT, tear down in reverse order.

    The ExitStack closes what was started, newest first: HTTP, server, CUDA
    devices (IPC handles and the arena's registration must go before the arena
    is unmapped), engine (stops writers, unlinks the segment), shared tier.
    """
    if guard.loaded:
        logger.info("accept guard loaded: an accept short of descriptors drops its connection")
    else:
        logger.warning(
            "accept guard not loaded (%s): libzmq may abort the sidecar when it runs out "
            "of file descriptors; the ZeroMQ endpoint's gate alone keeps it from that",
            guard.why_not,
        )
        # Without the guard, the gate must see libzmq's accepts within a fraction
        # of a millisecond while other threads run Python (an HTTP or liveness
        # flood): a thread waiting for the GIL gets it after at most this long
        # (5 ms by default, in which libzmq accepts hundreds of connections).
        sys.setswitchinterval(GIL_SWITCH_S)
    try:
        _pin(config)  # first: every thread started from here on inherits the mask
        with contextlib.ExitStack() as stack:
            server, http, engine = _start(config, stack)
            _serve_until_signalled(server, http, engine)
            return 0
    except _StartError as exc:
        print(f"kvstrata sidecar: {exc}", file=sys.stderr)
        return exc.exit_code


def _pin(config: SidecarConfig) -> None:
    """Pin the process to ``config.cpus`` (see kvstrata.sidecar.cpus); exit 2 when it cannot."""
    if config.cpus is None:
        return
    from kvstrata.sidecar.cpus import format_cpu_list, parse_cpu_list, pin_process

    cpus = parse_cpu_list(config.cpus)
    try:
        pin_process(cpus)
    except ValueError as exc:
        raise _StartError(str(exc), 2) from None
    logger.info("sidecar threads run on CPU(s) %s", format_cpu_list(cpus))


def _start(
    config: SidecarConfig, stack: contextlib.ExitStack
) -> tuple[SidecarServer, HttpEndpoints, StorageManager]:
    """Engine, ZMQ server and HTTP endpoints, each registered on ``stack`` for teardown."""
    import prometheus_client

    from kvstrata.sidecar.fdbudget import raise_nofile_limit

    # No *_created series: /metrics serves exactly the catalogue (docs/metrics.md).
    prometheus_client.disable_created_metrics()
    # Before anything opens descriptors; the server shares what is free once
    # the engine is up between its listeners and a reserve (see .fdbudget).
    raise_nofile_limit()
    keys = _open_keys(config, stack)
    shared = _open_shared_tier(config, keys, stack)
    engine = _open_engine(config, shared, keys, stack)
    server = _open_server(config, engine, shared is not None, keys, stack)
    http = _open_http(config, server, stack)
    http.start()
    return server, http, engine


def _open_shared_tier(
    config: SidecarConfig, keys: KeyRing | None, stack: contextlib.ExitStack
) -> Tier | None:
    """The shared tier the config names (None: none), watched for reachability."""
    if config.shared.backend == "none":
        return None
    from kvstrata.sidecar.tiers.factory import build_shared_tier
    from kvstrata.sidecar.tiers.reachability import ReachabilityWatch

    try:
        ttls = {t.name: t.ttl_seconds for t in config.tenants if t.ttl_seconds is not None}
        budgets = {t.name: t.budgets.shared_bytes for t in config.tenants if t.budgets.shared_bytes}
        shared = build_shared_tier(config.shared, ttls, keys=keys, tenant_budgets=budgets)
    except ValueError as exc:
        raise _StartError(str(exc), 2) from exc
    if shared is None:  # the factory's word for backend none
        return None
    stack.callback(shared.close)
    # Asked on a thread of its own: an unreachable server delays nothing.
    watch = ReachabilityWatch(shared, config.shared.breaker_reset_seconds)
    watch.start()
    stack.callback(watch.close)  # before shared.close (the stack unwinds newest first)
    return shared


def _open_engine(
    config: SidecarConfig, shared: Tier | None, keys: KeyRing | None, stack: contextlib.ExitStack
) -> StorageManager:
    from kvstrata.sidecar.engine import StorageManager

    try:
        engine = StorageManager(config, shared_tier=shared, keys=keys)
    except (OSError, ValueError) as exc:  # no room in /dev/shm, unwritable L2 path, ...
        raise _StartError(f"cannot start the engine: {exc}", 1) from exc
    stack.callback(engine.close)
    return engine


def _open_server(
    config: SidecarConfig,
    engine: StorageManager,
    remote_lookups: bool,
    keys: KeyRing | None,
    stack: contextlib.ExitStack,
) -> SidecarServer:
    """The ZMQ server, bound, with ipc mode where it can be served."""
    import zmq

    from kvstrata import __version__
    from kvstrata.sidecar.keymetrics import KeyRingCollector
    from kvstrata.sidecar.server import SidecarServer

    devices, ipc, ipc_unavailable = _open_ipc(config, engine)
    if devices is not None:
        stack.callback(devices.close)
    server = SidecarServer(
        config,
        engine,
        server_version=__version__,
        remote_lookups=remote_lookups,
        ipc=ipc,
        ipc_unavailable=ipc_unavailable,
    )
    stack.callback(server.close)
    server.metrics.attach(KeyRingCollector(keys))
    try:
        server.bind()
    except (zmq.ZMQError, OSError) as exc:
        where = config.server.endpoint
        raise _StartError(f"server.endpoint: cannot bind {where}: {exc}", 1) from exc
    return server


def _open_http(
    config: SidecarConfig, server: SidecarServer, stack: contextlib.ExitStack
) -> HttpEndpoints:
    """/metrics, /healthz, /readyz and /status, listening (not yet serving)."""
    from kvstrata.sidecar.http import HttpEndpoints

    try:
        http = HttpEndpoints(
            config.server.http_host,
            config.server.http_port,
            server.metrics.registry,
            ready=lambda: server.ready,
            status=server.status,
            max_connections=server.fd_budget.http,
            counts=server.connection_counts["http"],
        )
    except OSError as exc:
        where = f"{config.server.http_host}:{config.server.http_port}"
        raise _StartError(f"server.http_port: cannot listen on {where}: {exc}", 1) from exc
    stack.callback(http.close)
    return http


def _serve_until_signalled(
    server: SidecarServer, http: HttpEndpoints, engine: StorageManager
) -> None:
    import signal
    import threading

    from kvstrata import __version__

    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        logger.info("signal %d: shutting down", signum)
        stop.set()
        server.wake()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    logger.info(
        "kvstrata sidecar %s ready: zmq %s, http :%d, arena %s (%d bytes)",
        __version__,
        server.endpoint,
        http.port,
        engine.arena.name,
        engine.arena.size,
    )
    server.serve(stop)


def _open_ipc(
    config: SidecarConfig, engine: StorageManager
) -> tuple[CudaDevices | None, IpcTransfers | None, str]:
    """``(devices, IpcTransfers, why not)`` for ipc mode: the GPUs and the ops, or
    Nones and the reason HELLO gives clients that ask for ipc (they get host mode)."""
    if not config.transfer_mode.may_use_ipc:
        return None, None, "this sidecar is configured for transfer_mode host"
    from kvstrata.sidecar.transfer.cuda_device import open_cuda_devices
    from kvstrata.sidecar.transfer.ipc import IpcTransfers
    from kvstrata.sidecar.transfer_mode import ModeSetting

    devices, reason = open_cuda_devices(
        engine.arena,
        max_ctas=config.ipc.max_ctas,
        copy_path=config.ipc.copy_path,
        staging_bytes=config.ipc.staging_bytes,
    )
    if devices is None:
        # Asked for explicitly, a missing GPU path is worth a warning; under auto
        # (CPU nodes too) host mode is the expected outcome.
        level = logging.WARNING if config.transfer_mode is ModeSetting.IPC else logging.INFO
        logger.log(level, "transfer_mode %s: ipc unavailable, clients get host mode: %s",
                   config.transfer_mode.value, reason)  # fmt: skip
        return None, None, reason
    logger.info(
        "transfer_mode %s: ipc served with the csrc CUDA kernels", config.transfer_mode.value
    )
    return devices, IpcTransfers(engine, devices), ""
