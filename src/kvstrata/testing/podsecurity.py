"""The API server's PodSecurity admission, ``restricted`` profile, restated for pods.

Why this module exists: a cluster admin labels namespaces
``pod-security.kubernetes.io/enforce=restricted``, and the API server then
refuses any pod one of whose containers (injected ones included) breaks the
profile. A sidecar that lacks, say, ``seccompProfile`` makes every injected
pod of such a namespace fail to create, although the user's own containers
comply. The rules are those of kubernetes/pod-security-admission
(``policy/check_*.go``, "latest" version, which holds from 1.25 on), as
listed at https://kubernetes.io/docs/concepts/security/pod-security-standards/;
:func:`restricted_violations` returns one message per broken rule, naming
the container like the API server's refusal does, so cluster-free tests
find what the real API server (``tests/k8s``) would refuse.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

# check_restrictedVolumes.go: the only volume sources the restricted profile allows.
RESTRICTED_VOLUMES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}
# check_capabilities_baseline.go: what a container may add at all (baseline).
BASELINE_CAPABILITIES = {
    "AUDIT_WRITE",
    "CHOWN",
    "DAC_OVERRIDE",
    "FOWNER",
    "FSETID",
    "KILL",
    "MKNOD",
    "NET_BIND_SERVICE",
    "SETFCAP",
    "SETGID",
    "SETPCAP",
    "SETUID",
    "SYS_CHROOT",
}


def _containers(spec: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    for key in ("initContainers", "containers", "ephemeralContainers"):
        yield from spec.get(key) or []


def _host_checks(spec: Mapping[str, Any]) -> list[str]:
    """Baseline: host namespaces, hostPath and host ports (check_hostNamespaces.go etc.)."""
    out = [f"{key}=true" for key in ("hostNetwork", "hostPID", "hostIPC") if spec.get(key)]
    for volume in spec.get("volumes") or []:
        kinds = set(volume) - {"name"}
        if "hostPath" in kinds:
            out.append(f'hostPath volume "{volume["name"]}"')
        elif not kinds <= RESTRICTED_VOLUMES:
            out.append(f'restricted volume types: volume "{volume["name"]}" uses {sorted(kinds)}')
    return out


def _container_checks(container: Mapping[str, Any], pod_ctx: Mapping[str, Any]) -> Iterator[str]:
    name = container.get("name")
    ctx = container.get("securityContext") or {}
    if ctx.get("privileged"):
        yield f'privileged: container "{name}" must not set securityContext.privileged=true'
    for port in container.get("ports") or []:
        if port.get("hostPort"):
            yield f'hostPort: container "{name}" uses hostPort {port["hostPort"]}'
    # check_allowPrivilegeEscalation.go: must be set, to false, on every container.
    if ctx.get("allowPrivilegeEscalation") is not False:
        yield (
            f'allowPrivilegeEscalation != false: container "{name}" must set '
            "securityContext.allowPrivilegeEscalation=false"
        )
    # check_capabilities_restricted.go: drop ALL; add nothing but NET_BIND_SERVICE.
    caps = ctx.get("capabilities") or {}
    if "ALL" not in (caps.get("drop") or []):
        yield f'unrestricted capabilities: container "{name}" must set capabilities.drop=["ALL"]'
    added = set(caps.get("add") or []) - {"NET_BIND_SERVICE"}
    if added:
        yield f'unrestricted capabilities: container "{name}" must not add {sorted(added)}'
    # check_runAsNonRoot.go: true at the container, or at the pod and not false here.
    non_root = ctx.get("runAsNonRoot", pod_ctx.get("runAsNonRoot"))
    if non_root is not True:
        yield f'runAsNonRoot != true: container "{name}" must set securityContext.runAsNonRoot=true'
    # check_runAsUser.go: never user 0, at either level.
    if ctx.get("runAsUser", pod_ctx.get("runAsUser")) == 0:
        yield f'runAsUser=0: container "{name}" must not set runAsUser=0'
    # check_seccompProfile_restricted.go: RuntimeDefault or Localhost, here or on the pod.
    profile = (ctx.get("seccompProfile") or pod_ctx.get("seccompProfile") or {}).get("type")
    if profile not in ("RuntimeDefault", "Localhost"):
        yield (
            f'seccompProfile: container "{name}" must set securityContext.seccompProfile.type '
            'to "RuntimeDefault" or "Localhost"'
        )


def restricted_violations(pod: Mapping[str, Any]) -> list[str]:
    """What the ``restricted`` profile refuses in ``pod`` (empty: it is admitted)."""
    spec = pod.get("spec") or {}
    pod_ctx = spec.get("securityContext") or {}
    out = _host_checks(spec)
    if pod_ctx.get("runAsUser") == 0:
        out.append("runAsUser=0: the pod must not set runAsUser=0")
    for container in _containers(spec):
        out.extend(_container_checks(container, pod_ctx))
        adds = set(
            ((container.get("securityContext") or {}).get("capabilities") or {}).get("add") or []
        )
        if adds - BASELINE_CAPABILITIES:
            out.append(f'non-default capabilities: container "{container.get("name")}"')
    return out
