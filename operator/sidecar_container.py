"""The containers an injected pod gets: the installer and the cache sidecar.

Why a module of its own: what the sidecar container is (image by GPU
visibility, the user it runs as, its probes, its memory sized to L1, the
"restricted" Pod Security settings) changes with the sidecar, not with the
decision to inject (:mod:`.mutate`) or the volumes (:mod:`.pod_volumes`).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from typing import Any

from kvstrata.operator import spec as S
from kvstrata.operator.model import SidecarSpec
from kvstrata.operator.pod_volumes import mebibytes
from kvstrata.sidecar.config import SidecarConfig
from kvstrata.sidecar.transfer_mode import ModeSetting

__all__ = [
    "INSTALLER",
    "SIDECAR",
    "gpu_visibility_env",
    "installer_container",
    "sidecar_container",
    "startup_budget_s",
]

SIDECAR = "kvstrata-sidecar"
INSTALLER = "kvstrata-install"
SIDECAR_OVERHEAD_BYTES = 512 << 20
# The sidecar's startup probe budget: the start itself (interpreter, imports,
# tiers) plus the time to reserve every L1 page (posix_fallocate on /dev/shm,
# sidecar/arena.py), at a rate well below tmpfs's: about 4 GiB/s measured on a
# shared 2-core VM; 2 s per GiB allows for a node eight times slower.
STARTUP_BASE_S = 120
STARTUP_S_PER_GIB = 2


def _security_context(overrides: Mapping[str, Any] | None) -> dict[str, Any]:
    # What the "restricted" Pod Security Standard asks of every container, so that
    # injecting never gets a complying pod refused in a namespace that enforces it;
    # the seccomp profile is set here, as the pod-level one is the user's to choose.
    ctx: dict[str, Any] = {
        "runAsNonRoot": True,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    ctx.update(overrides or {})
    return ctx


def _image_of(sidecar: SidecarSpec, default: S.Image) -> tuple[str, str]:
    """The image and pull policy the KVCache names, each else the operator's default."""
    ref = sidecar.image if sidecar.image is not None else default.ref
    policy = sidecar.image_pull_policy
    return ref, policy if policy is not None else default.pull_policy


def installer_container(sidecar: SidecarSpec, image: S.Image) -> dict[str, Any]:
    ref, policy = _image_of(sidecar, image)
    return {
        "name": INSTALLER,
        "image": ref,
        "imagePullPolicy": policy,
        "command": ["python", "-m", "kvstrata.operator.install", S.PYTHON_DIR],
        "resources": {
            "requests": {"cpu": "50m", "memory": "64Mi"},
            "limits": {"memory": "128Mi"},
        },
        "securityContext": _security_context(sidecar.security_context),
        "volumeMounts": [{"name": "kvstrata-python", "mountPath": S.PYTHON_DIR}],
    }


def gpu_visibility_env(vllm: Mapping[str, Any], mode: ModeSetting) -> list[dict[str, Any]]:
    if not mode.may_use_ipc:
        return []
    for env in vllm.get("env") or []:
        if env.get("name") == "NVIDIA_VISIBLE_DEVICES" and "value" in env:
            visible = env["value"]
            break
    else:
        resources = vllm.get("resources") or {}
        wants = {**(resources.get("requests") or {}), **(resources.get("limits") or {})}
        if not any(k.endswith("/gpu") and str(v) != "0" for k, v in wants.items()):
            return []
        # Which GPUs the device plugin gives vLLM is not known at admission, so
        # the sidecar sees them all and opens only the one each worker names by
        # UUID; it creates no CUDA context before that (CudaDevices), so no
        # other GPU of the node is touched.
        visible = "all"
    return [
        {"name": "NVIDIA_VISIBLE_DEVICES", "value": visible},
        {"name": "NVIDIA_DRIVER_CAPABILITIES", "value": "compute,utility"},
    ]


def _sidecar_resources(sidecar: SidecarSpec, l1_bytes: int) -> dict[str, Any]:
    memory = mebibytes(l1_bytes + SIDECAR_OVERHEAD_BYTES)
    resources = {"requests": {"cpu": "500m", "memory": memory}, "limits": {"memory": memory}}
    custom = sidecar.resources or {}
    for section in ("requests", "limits"):
        resources[section].update(custom.get(section) or {})
    return resources


def sidecar_container(
    sidecar: SidecarSpec,
    config: SidecarConfig,
    mounts: list[dict[str, Any]],
    gpu_env: list[dict[str, Any]],
    vllm: Mapping[str, Any],
    pod_spec: Mapping[str, Any],
    image: S.Image,
) -> dict[str, Any]:
    port = config.server.http_port

    def ready(period: int) -> dict[str, Any]:
        return {
            "httpGet": {"path": "/readyz", "port": S.METRICS_PORT_NAME},
            "periodSeconds": period,
        }

    overrides = dict(sidecar.security_context or {})
    # Run as the vLLM container's user, so both can use the socket and the arena.
    for source in ((vllm.get("securityContext") or {}), (pod_spec.get("securityContext") or {})):
        for key in ("runAsUser", "runAsGroup"):
            if key in source and key not in overrides:
                overrides[key] = source[key]
    ctx = _security_context(overrides)
    if ctx.get("runAsUser") == 0:
        ctx["runAsNonRoot"] = False
    env = [
        {"name": "PYTHONHASHSEED", "value": "0"},
        {"name": "TMPDIR", "value": S.SOCKET_DIR},
        *gpu_env,
        *copy.deepcopy(sidecar.env or []),
    ]
    ref, policy = _image_of(sidecar, image)
    return {
        "name": SIDECAR,
        "image": ref,
        "imagePullPolicy": policy,
        "restartPolicy": "Always",
        "command": ["kvstrata", "sidecar", "--config", S.CONFIG_PATH],
        "env": env,
        "ports": [{"name": S.METRICS_PORT_NAME, "containerPort": port, "protocol": "TCP"}],
        "startupProbe": {**ready(1), "failureThreshold": startup_budget_s(config.l1.size_bytes)},
        "readinessProbe": ready(5),
        "livenessProbe": {
            "httpGet": {"path": "/healthz", "port": S.METRICS_PORT_NAME},
            "periodSeconds": 10,
            "failureThreshold": 3,
        },
        "resources": _sidecar_resources(sidecar, config.l1.size_bytes),
        "securityContext": ctx,
        "volumeMounts": mounts,
    }


def startup_budget_s(l1_bytes: int) -> int:
    """Seconds the sidecar may take to serve /readyz (1 s probe period: the failure threshold)."""
    return STARTUP_BASE_S + STARTUP_S_PER_GIB * math.ceil(l1_bytes / (1 << 30))
