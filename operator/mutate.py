"""Inject the kvstrata sidecar into a Pod: a plain function returning a JSON patch.

Why this module exists: the admission webhook must be right on every pod
shape and must never block a pod, so the whole decision is one pure function,
:func:`mutate_pod`, tested without a cluster; the kopf handler only fetches
the KVCache and hands the patch back.

What an injected pod gets (pod annotated ``kvstrata.io/cache: NAME``):

* init container ``kvstrata-install`` (the installer image: by default the
  host-mode sidecar image) copying the pure
  Python ``kvstrata`` package (and msgpack, which vLLM lacks; see
  :mod:`kvstrata.operator.install`) into the emptyDir ``kvstrata-python``, mounted
  read-only at ``/opt/kvstrata/python`` in the vLLM container and prepended to
  its ``PYTHONPATH``: any stock vLLM image can load the connector. Images that
  ship kvstrata opt out with ``kvstrata.io/inject-package: "false"``.
* native sidecar ``kvstrata-sidecar`` (init container, ``restartPolicy:
  Always``): ``kvstrata sidecar --config /etc/kvstrata/sidecar.yaml``, from
  the CUDA sidecar image when it is given a GPU (below), else the slim one; its
  startup probe on ``/readyz`` makes the kubelet start vLLM only once the
  sidecar serves. Memory request = limit = L1 + 512Mi (the L1 arena lives in
  the shared ``/dev/shm`` and is charged to the sidecar that touches it).
* volumes: socket dir (``/var/run/kvstrata``, endpoint
  ``ipc:///var/run/kvstrata/sidecar.sock``), a memory emptyDir at ``/dev/shm``
  in both containers sized L1 + 10% + 256Mi (an existing ``/dev/shm`` mount
  of the vLLM container is reused instead), the config map, L2, and the
  Secrets the config points at.
* the vLLM container: ``PYTHONHASHSEED=0`` when unset and
  ``--kv-transfer-config <json>`` appended to its arguments (or to the script
  of a ``sh -c`` command, whose last command must then be vLLM).

Which container is vLLM: the one named by ``kvstrata.io/vllm-container``;
else the first whose command or args mention ``vllm``; else the first whose
image name contains ``vllm``; else the first one.

GPU visibility (``transferMode`` ipc or auto): the sidecar gets the vLLM
container's ``NVIDIA_VISIBLE_DEVICES`` when the pod spec sets it, else
``all`` when the vLLM container requests ``nvidia.com/gpu`` (the connector
names its device by UUID, so the sidecar maps the right one; it creates a
CUDA context only on the GPUs its workers register, never on GPU 0 of the
node by default). Such pods also get ``shareProcessNamespace: true``: CUDA
IPC handles do not open across PID namespaces.

Never blocking: anything that cannot be done leaves the pod as it was but for
the annotation ``kvstrata.io/injection-skipped: <reason>``.
"""

from __future__ import annotations

import copy
import json
import posixpath
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvstrata.connector.transfer_config import kv_transfer_config
from kvstrata.operator import spec as S
from kvstrata.operator.model import KVCache, KVCacheLike
from kvstrata.operator.pod_volumes import (
    key_volumes,
    l2_volume,
    mebibytes,
    secret_volumes,
    shm_volume_of,
)
from kvstrata.operator.sidecar_container import (
    SIDECAR,
    gpu_visibility_env,
    installer_container,
    sidecar_container,
)
from kvstrata.sidecar.config import SidecarConfig

# Room in the /dev/shm emptyDir beside the L1 arena (and its 10%) for vLLM's own use.
SHM_HEADROOM_BYTES = 256 << 20
SHELLS = {"sh", "bash", "dash", "ash", "zsh"}
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


@dataclass(frozen=True, slots=True)
class MutationResult:
    """``patch``: RFC 6902 ops against the submitted pod ([] = leave it as it is).

    ``injected`` says the sidecar was added; ``skipped`` carries the reason
    when the pod asked for a cache but was left without one, and
    ``skip_code`` the same as a short code (a metric label).
    """

    patch: list[dict[str, Any]]
    injected: bool = False
    skipped: str | None = None
    skip_code: str | None = None


def transfer_config(timeout_s: float = 0.5) -> dict[str, Any]:
    """The ``--kv-transfer-config`` value the vLLM container is given.

    With ``kv_load_failure_policy: recompute``: vLLM's default (``fail``) would
    turn a cache load that fails after a hit into a failed request. (The
    field exists in every vLLM the connector supports.)
    """
    return kv_transfer_config(S.ENDPOINT, call_timeout_seconds=timeout_s)


def _diff(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[dict[str, Any]]:
    import jsonpatch

    return list(jsonpatch.JsonPatch.from_diff(dict(before), dict(after)).patch)


def _skip(pod: Mapping[str, Any], code: str, reason: str) -> MutationResult:
    after = copy.deepcopy(dict(pod))
    after.setdefault("metadata", {}).setdefault("annotations", {})[S.SKIPPED_ANNOTATION] = reason
    return MutationResult(patch=_diff(pod, after), skipped=reason, skip_code=code)


def find_vllm_container(pod: Mapping[str, Any]) -> tuple[int | None, str | None]:
    """Index of the vLLM container, or None and the reason it cannot be found."""
    containers = (pod.get("spec") or {}).get("containers") or []
    if not containers:
        return None, "the pod has no containers"
    wanted = ((pod.get("metadata") or {}).get("annotations") or {}).get(S.VLLM_CONTAINER_ANNOTATION)
    if wanted is not None:
        for i, c in enumerate(containers):
            if c.get("name") == wanted:
                return i, None
        return (
            None,
            f"container {wanted!r} named by {S.VLLM_CONTAINER_ANNOTATION} is not in the pod",
        )
    for i, c in enumerate(containers):
        argv = [str(a) for a in (c.get("command") or []) + (c.get("args") or [])]
        if any("vllm" in a.lower() for a in argv):
            return i, None
    for i, c in enumerate(containers):  # e.g. vllm/vllm-openai, whose entrypoint runs vLLM
        if "vllm" in str(c.get("image", "")).lower():
            return i, None
    return 0, None


def _already_configured(container: Mapping[str, Any]) -> bool:
    argv = [str(a) for a in (container.get("command") or []) + (container.get("args") or [])]
    return any("--kv-transfer-config" in a for a in argv)


def mutate_pod(
    pod: Mapping[str, Any],
    kvcache: KVCacheLike | None,
    namespace: str | None = None,
    missing_reason: str | None = None,
    images: S.Images | None = None,
    unsupported_reason: str | None = None,
) -> MutationResult:
    """Decide what to do with a pod at CREATE; never raises for pod or spec content.

    ``kvcache`` None means the named KVCache is absent; ``missing_reason``
    says why when it could not be read at all. ``images``: the defaults for
    a KVCache that names no sidecar image (else the operator's environment).
    ``unsupported_reason``: why this cluster cannot run the sidecar (e.g. an
    API server without native sidecars); the pod is then skipped with it.
    """
    meta = pod.get("metadata") or {}
    annotations = meta.get("annotations") or {}
    name = annotations.get(S.CACHE_ANNOTATION)
    if name is None:
        return MutationResult(patch=[])  # not ours
    init_names = {c.get("name") for c in (pod.get("spec") or {}).get("initContainers") or []}
    if SIDECAR in init_names or S.INJECTED_ANNOTATION in annotations:
        return MutationResult(patch=[])  # already injected: idempotent
    if S.SKIPPED_ANNOTATION in annotations:
        return MutationResult(patch=[])
    if not isinstance(name, str) or len(name) > 253 or not _DNS_SUBDOMAIN.match(name):
        reason = f"bad annotation {S.CACHE_ANNOTATION}={name!r}: not a KVCache name"
        return _skip(pod, "bad_annotation", reason)
    if unsupported_reason:
        return _skip(pod, "unsupported_cluster", unsupported_reason)
    ns = namespace or meta.get("namespace") or "default"
    if kvcache is None:
        if missing_reason:
            return _skip(pod, "api_error", missing_reason)
        return _skip(pod, "kvcache_not_found", f"KVCache {ns}/{name} not found")
    try:
        kvcache = KVCache.parse(kvcache)
        config, text = S.render_sidecar_config(kvcache)
    except S.SpecError as exc:
        return _skip(pod, "invalid_spec", f"KVCache {ns}/{name} has an invalid spec: {exc}")
    index, why = find_vllm_container(pod)
    if index is None:
        return _skip(pod, "no_vllm_container", str(why))
    vllm = pod["spec"]["containers"][index]
    if _already_configured(vllm):
        reason = f"container {vllm.get('name')!r} already sets --kv-transfer-config"
        return _skip(pod, "already_configured", reason)
    inject_package = annotations.get(S.INJECT_PACKAGE_ANNOTATION, "true").lower() != "false"
    after = copy.deepcopy(dict(pod))
    digest = S.config_hash(kvcache, text)
    _inject(after, index, kvcache, config, digest, inject_package, images or S.Images.from_env())
    return MutationResult(patch=_diff(pod, after), injected=True)


def _inject(
    pod: dict[str, Any],
    index: int,
    kvcache: KVCache,
    config: SidecarConfig,
    digest: str,
    inject_package: bool,
    images: S.Images,
) -> None:
    spec = kvcache.spec
    name = kvcache.name
    meta = pod.setdefault("metadata", {})
    meta.setdefault("annotations", {})[S.INJECTED_ANNOTATION] = digest
    # What the metrics Service selects and status counts (shortened when too long).
    meta.setdefault("labels", {})[S.CACHE_LABEL] = S.cache_label_value(name)
    pod_spec = pod.setdefault("spec", {})
    vllm = pod_spec["containers"][index]
    volumes = pod_spec.setdefault("volumes", [])
    shm_volume = shm_volume_of(vllm)
    l1 = config.l1.size_bytes
    if shm_volume is None:
        shm_volume = "kvstrata-shm"
        size = mebibytes(l1 + l1 // 10 + SHM_HEADROOM_BYTES)
        volumes.append({"name": shm_volume, "emptyDir": {"medium": "Memory", "sizeLimit": size}})
        vllm.setdefault("volumeMounts", []).append({"name": shm_volume, "mountPath": "/dev/shm"})
    volumes.append({"name": "kvstrata-socket", "emptyDir": {}})
    volumes.append({"name": "kvstrata-config", "configMap": {"name": S.configmap_name(name)}})
    sidecar_mounts = [
        {"name": "kvstrata-socket", "mountPath": S.SOCKET_DIR},
        {"name": shm_volume, "mountPath": "/dev/shm"},
        {"name": "kvstrata-config", "mountPath": S.CONFIG_DIR, "readOnly": True},
    ]
    if config.l2.enabled:
        volumes.append(l2_volume(spec.l2.volume, config.l2.size_bytes))
        sidecar_mounts.append({"name": "kvstrata-l2", "mountPath": S.L2_DIR})
    for volume, mount in [*secret_volumes(kvcache), *key_volumes(kvcache)]:
        volumes.append(volume)
        sidecar_mounts.append(mount)
    vllm.setdefault("volumeMounts", []).append(
        {"name": "kvstrata-socket", "mountPath": S.SOCKET_DIR}
    )
    init = pod_spec.setdefault("initContainers", [])
    if inject_package:
        volumes.append({"name": "kvstrata-python", "emptyDir": {}})
        init.append(installer_container(spec.sidecar, images.installer))
        vllm["volumeMounts"].append(
            {"name": "kvstrata-python", "mountPath": S.PYTHON_DIR, "readOnly": True}
        )
    gpu_env = gpu_visibility_env(vllm, config.transfer_mode)
    # A sidecar that sees a GPU gets the CUDA image (its kernels); else the slim one.
    image = images.sidecar_cuda if gpu_env else images.sidecar
    if gpu_env:
        _share_process_namespace(pod_spec)
    init.append(
        sidecar_container(spec.sidecar, config, sidecar_mounts, gpu_env, vllm, pod_spec, image)
    )
    _configure_vllm(vllm, inject_package)


def _share_process_namespace(pod_spec: dict[str, Any]) -> None:
    """One PID namespace for the pod's containers, so ipc mode can work.

    Legacy CUDA IPC memory handles and interprocess events do not open
    across PID namespaces (openucx/ucx#11514, NVIDIA/nccl#360), and a Pod's
    containers each have their own unless ``shareProcessNamespace`` is true.
    Set for every pod whose sidecar sees a GPU (ipc, or auto on a GPU pod):
    those are the pods that can use ipc. A pod that says ``false`` keeps
    it (its workers then get host mode, and say why).
    """
    pod_spec.setdefault("shareProcessNamespace", True)


# vLLM's flag that loads the admission check of kv_transfer_params.
PARAMS_CHECK = ("--logits-processors", "kvstrata.connector.params_check:KVStrataParamsCheck")


def _configure_vllm(vllm: dict[str, Any], inject_package: bool) -> None:
    env = vllm.setdefault("env", [])
    names = {e.get("name") for e in env}
    if "PYTHONHASHSEED" not in names:
        env.append({"name": "PYTHONHASHSEED", "value": "0"})
    if inject_package:
        current = next((e for e in env if e.get("name") == "PYTHONPATH"), None)
        if current is None:
            env.append({"name": "PYTHONPATH", "value": S.PYTHON_DIR})
        elif "value" in current:
            current["value"] = (
                f"{S.PYTHON_DIR}:{current['value']}" if current["value"] else S.PYTHON_DIR
            )
    flag = json.dumps(transfer_config(), separators=(",", ":"))
    command, args = vllm.get("command") or [], vllm.get("args") or []
    argv = [*command, *args]
    # The check that answers a bad kv_transfer_params with a 400
    # (kvstrata.connector.params_check); a container that sets its own logits
    # processors keeps them (argparse keeps the last flag), and such requests
    # then get no load and no store instead.
    check = [] if any("--logits-processors" in str(a) for a in argv) else [*PARAMS_CHECK]
    if argv and posixpath.basename(str(argv[0])) in SHELLS and "-c" in argv[:-1]:
        at = argv.index("-c") + 1
        target, offset = (command, 0) if at < len(command) else (args, len(command))
        target[at - offset] = " ".join(
            [target[at - offset], "--kv-transfer-config", f"'{flag}'", *check]
        )
        return
    vllm["args"] = [*args, *check, "--kv-transfer-config", flag]
