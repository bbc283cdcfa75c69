"""A sidecar process whose ipc-mode GPU is the shared-memory stand-in (a test double).

``python -m kvstrata.testing.shmsidecar ROOT GPU_UUID`` serves a small
engine on ``ipc://ROOT/sidecar.sock`` with the real server, protocol,
registration checks and engine, its one "GPU" a
:class:`~kvstrata.testing.shmdevice.SharedMemoryDevice` known by
``GPU_UUID``. It prints ``ready <endpoint>`` once it serves and stops on
SIGTERM. Tests use it to show that what a client sends cannot take the
sidecar process down (a copy past a mapping is a SIGSEGV here, as it is
an illegal address on a GPU).
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvstrata.sidecar.config import config_from_dict
from kvstrata.sidecar.engine import StorageManager
from kvstrata.sidecar.server import SidecarServer
from kvstrata.sidecar.transfer.ipc import IpcTransfers
from kvstrata.testing.shmdevice import SharedMemoryDevice


def build(
    root: Path,
    gpu_uuid: str,
    opening: Callable[[], None] | None = None,
    device: Callable[[int], SharedMemoryDevice] = SharedMemoryDevice,
    workers: int = 4,
    tenants: Sequence[Mapping[str, Any]] = (),
) -> tuple[StorageManager, SharedMemoryDevice, IpcTransfers, SidecarServer]:
    """The small engine, its stand-in GPU (known as ``gpu_uuid``), the ipc
    transfers over it and the real server over them, bound to nothing yet;
    in-process tests use it too. ``opening``: called each time a registration
    opens the GPU, before it is handed out (a test holds it there, as
    page-locking a large arena at a first registration takes seconds).
    ``device``: the stand-in's class, given the arena's address (a test's
    subclass of :class:`SharedMemoryDevice`); ``workers``: the server's pool's
    threads; ``tenants``: the config's ``tenants``."""
    config = config_from_dict(
        {
            "chunk_size": 32,
            "l1": {"size_bytes": "8Mi", "pin_memory": False},
            "l2": {"path": str(root / "l2"), "size_bytes": "16Mi"},
            "server": {"endpoint": f"ipc://{root}/sidecar.sock", "http_port": 0},
            "tenants": [dict(t) for t in tenants],
        }
    )
    engine = StorageManager(config)
    made = device(engine.arena.address())

    def open_device(gpu: str) -> SharedMemoryDevice:
        if gpu != gpu_uuid:
            raise OSError(f"no GPU {gpu} visible here")
        if opening is not None:
            opening()
        return made

    ipc = IpcTransfers(engine, open_device)
    server = SidecarServer(config, engine, server_version="test", ipc=ipc, workers=workers)
    return engine, made, ipc, server


class ServedOnThread:
    """:func:`build`'s sidecar serving on a thread of the test's own process, so
    that in-process tests reach its engine, device and ipc transfers directly;
    the arguments are :func:`build`'s. ``close()`` stops it."""

    def __init__(
        self,
        root: Path,
        gpu_uuid: str,
        opening: Callable[[], None] | None = None,
        device: Callable[[int], SharedMemoryDevice] = SharedMemoryDevice,
        workers: int = 4,
        tenants: Sequence[Mapping[str, Any]] = (),
    ) -> None:
        self.engine, self.device, self.ipc, self.server = build(
            root, gpu_uuid, opening, device, workers, tenants
        )
        self.endpoint = self.server.bind()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.server.serve, args=(self.stop,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        self.server.wake()
        self.thread.join(timeout=10)
        self.server.close()
        self.engine.close()


def main(root: Path, gpu_uuid: str) -> None:
    engine, _device, _ipc, server = build(root, gpu_uuid)
    endpoint = server.bind()
    stop = threading.Event()

    def on_signal(_signum: int, _frame: object) -> None:
        stop.set()
        server.wake()

    signal.signal(signal.SIGTERM, on_signal)
    print(f"ready {endpoint}", flush=True)
    try:
        server.serve(stop)
    finally:
        server.close()
        engine.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
