"""An injected pod in a namespace that enforces the ``restricted`` Pod Security Standard.

A cluster admin labels a namespace ``pod-security.kubernetes.io/enforce=restricted``
and a user whose own vLLM container complies expects the injected pod to be
admitted: what the webhook adds must comply too. The API server's PodSecurity
admission is modelled by :mod:`kvstrata.testing.podsecurity`; ``tests/k8s``
shows the same pod admitted by a real API server.
"""

from __future__ import annotations

import copy

import jsonpatch
import pytest

from kvstrata.operator import spec as S
from kvstrata.operator.mutate import mutate_pod
from kvstrata.operator.sidecar_container import INSTALLER, SIDECAR
from kvstrata.testing.podsecurity import restricted_violations

RESTRICTED_CONTAINER_CONTEXT = {
    "runAsNonRoot": True,
    "runAsUser": 1000,
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}


def restricted_vllm_pod(make_pod, **spec) -> dict:
    """A vLLM pod that the restricted profile admits as it is."""
    pod = make_pod({S.CACHE_ANNOTATION: "demo"}, **spec)
    pod["spec"]["containers"][0]["securityContext"] = copy.deepcopy(RESTRICTED_CONTAINER_CONTEXT)
    return pod


def test_a_restricted_pod_stays_restricted_once_injected(make_pod, make_kvcache):
    pod = restricted_vllm_pod(make_pod)
    assert restricted_violations(pod) == []
    result = mutate_pod(pod, make_kvcache())
    assert result.injected
    out = jsonpatch.apply_patch(copy.deepcopy(pod), result.patch)
    assert {c["name"] for c in out["spec"]["initContainers"]} >= {SIDECAR, INSTALLER}
    assert restricted_violations(out) == []


@pytest.mark.parametrize("name", [SIDECAR, INSTALLER])
def test_every_injected_container_sets_the_runtime_default_seccomp_profile(
    make_pod, make_kvcache, name
):
    # Set on the container itself: a pod-level profile is the user's to choose or omit.
    pod = make_pod({S.CACHE_ANNOTATION: "demo"})
    out = jsonpatch.apply_patch(copy.deepcopy(pod), mutate_pod(pod, make_kvcache()).patch)
    injected = next(c for c in out["spec"]["initContainers"] if c["name"] == name)
    assert injected["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}


@pytest.mark.parametrize(
    ("change", "refusal"),
    [
        (lambda ctx: ctx.pop("seccompProfile"), "seccompProfile"),
        (lambda ctx: ctx.update(allowPrivilegeEscalation=True), "allowPrivilegeEscalation"),
        (lambda ctx: ctx.update(capabilities={"add": ["NET_ADMIN"]}), "capabilities"),
        (lambda ctx: ctx.update(runAsNonRoot=False), "runAsNonRoot"),
        (lambda ctx: ctx.update(runAsUser=0), "runAsUser=0"),
    ],
)
def test_the_model_refuses_what_the_restricted_profile_refuses(make_pod, change, refusal):
    pod = restricted_vllm_pod(make_pod)
    change(pod["spec"]["containers"][0]["securityContext"])
    assert any(refusal in v and '"vllm"' in v for v in restricted_violations(pod))


def test_the_model_refuses_host_paths_and_host_namespaces(make_pod):
    pod = restricted_vllm_pod(
        make_pod, hostPID=True, volumes=[{"name": "h", "hostPath": {"path": "/"}}]
    )
    assert restricted_violations(pod) == ["hostPID=true", 'hostPath volume "h"']
