"""Which PID namespace the GPU selftest's worker processes run in.

CUDA IPC memory handles and interprocess events do not open across PID
namespaces (openucx/ucx#11514, NVIDIA/nccl#360; see docs/gpu.md). A Pod's
containers each have their own unless the Pod sets
``shareProcessNamespace: true``, which the operator's webhook does for
every Pod whose sidecar sees a GPU. So the selftest runs its "vLLM"
workers as such a Pod runs them:

* ``pod`` (default): one namespace for the sidecar side and the workers,
  as in the operator's Pods;
* ``separate``: each worker in a PID namespace of its own (``unshare
  --pid --fork``, root only), as in a Pod that keeps
  ``shareProcessNamespace: false``: the ipc checks then fail where such a
  Pod's workers would fall back to host mode.

The mode comes from ``kvstrata selftest gpu --pid-namespace`` (or the
:data:`ENV` variable, which that option sets for the checks).
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path

from kvstrata.testing.gpuipc import CheckFailed

ENV = "KVSTRATA_SELFTEST_PID_NAMESPACE"
POD, SEPARATE = "pod", "separate"
MODES = (POD, SEPARATE)


def mode() -> str:
    """The configured mode; CheckFailed naming the variable for another value."""
    value = os.environ.get(ENV, POD)
    if value not in MODES:
        raise CheckFailed(f"{ENV}={value!r}: one of {', '.join(MODES)}")
    return value


def worker_executable(
    chosen: str,
    directory: Path,
    *,
    euid: int | None = None,
    unshare: str | None = None,
    python: str = sys.executable,
) -> str | None:
    """What multiprocessing spawns the workers with: None for the interpreter
    itself (``pod``), else a script in ``directory`` that starts it in a PID
    namespace of its own. CheckFailed when ``separate`` cannot be had here."""
    if chosen == POD:
        return None
    euid = os.geteuid() if euid is None else euid
    unshare = shutil.which("unshare") if unshare is None else unshare
    if euid != 0:
        raise CheckFailed("--pid-namespace separate needs root (unshare --pid)")
    if not unshare:
        raise CheckFailed("--pid-namespace separate needs util-linux's unshare")
    script = directory / "python-in-own-pid-namespace"
    # --kill-child: a SIGKILL to unshare (what the checks send a worker) ends the worker too.
    command = shlex.join([unshare, "--pid", "--fork", "--kill-child", python])
    script.write_text(f'#!/bin/sh\nexec {command} "$@"\n')
    script.chmod(0o755)
    return str(script)
