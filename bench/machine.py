"""A short description of the machine a benchmark ran on."""

from __future__ import annotations

import os
import platform


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


def _gpu() -> str | None:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except Exception:  # torch missing or broken: no GPU figure to report
        return None
    return None


def machine_info() -> dict[str, object]:
    cpus = os.cpu_count() or 0
    mem = _memory_bytes()
    gpu = _gpu()
    summary = f"{_cpu_model()}, {cpus} cores, {mem / 2**30:.0f} GiB" + (f", {gpu}" if gpu else "")
    return {
        "summary": summary,
        "cpu": _cpu_model(),
        "cores": cpus,
        "memory_bytes": mem,
        "gpu": gpu,
        "python": platform.python_version(),
        "kernel": platform.release(),
    }
