"""The suite's one node: it registers Ready with a private address, and runs a pod on the
pod network, from the node's local pause image, until the pod is deleted.

These skip (saying why) where there is no node: see the ``node`` fixture.
"""

from __future__ import annotations

import ipaddress
import uuid

import pytest
from kubernetes import client

from kvstrata.testing import pauseimage

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

POD_TIMEOUT_S = 120


def stand_in_pod(name: str, namespace: str) -> dict:
    """A pod whose one container is the pause binary: Running until it is deleted."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "terminationGracePeriodSeconds": 5,
            "containers": [
                {"name": "main", "image": pauseimage.REFERENCE, "imagePullPolicy": "Never"}
            ],
        },
    }


def default_service_account(kube, namespace: str, wait_for) -> None:
    """Pods need it; the controller manager makes it just after the namespace."""
    core = client.CoreV1Api(kube.api)
    wait_for(
        lambda: any(
            a.metadata.name == "default"
            for a in core.list_namespaced_service_account(namespace).items
        ),
        60,
        f"the default service account of {namespace}",
    )


def test_the_node_registers_ready_with_its_bridge_address_as_internal_ip(kube, node):
    found = client.CoreV1Api(kube.api).read_node(node.name)
    addresses = {a.type: a.address for a in found.status.addresses}
    internal = ipaddress.ip_address(addresses["InternalIP"])
    assert not internal.is_loopback
    assert internal == ipaddress.ip_address(node.pod_network.node_ip)
    ready = next(c for c in found.status.conditions if c.type == "Ready")
    assert ready.status == "True"


def test_a_pod_runs_on_the_pod_network_until_it_is_deleted(kube, namespace, node, wait_for):
    default_service_account(kube, namespace, wait_for)
    name = f"stand-in-{uuid.uuid4().hex[:4]}"
    kube.apply(stand_in_pod(name, namespace))

    def running() -> dict | None:
        found = kube.get("v1", "Pod", namespace, name) or {}
        status = found.get("status") or {}
        return found if status.get("phase") == "Running" and status.get("podIP") else None

    pod = wait_for(running, POD_TIMEOUT_S, f"pod {name} Running with an IP")
    assert pod["spec"]["nodeName"] == node.name  # placed by the scheduler
    assert pod["status"]["hostIP"] == node.pod_network.node_ip
    assert ipaddress.ip_address(pod["status"]["podIP"]) in node.pod_network.subnet
    assert pod["status"]["podIP"] != node.pod_network.node_ip  # its own network namespace
    kube.delete("v1", "Pod", namespace, name)
    # The kubelet stops the containers and confirms; only then is the pod gone.
    wait_for(
        lambda: kube.get("v1", "Pod", namespace, name) is None,
        POD_TIMEOUT_S,
        f"pod {name} to be stopped by the kubelet and deleted",
    )
