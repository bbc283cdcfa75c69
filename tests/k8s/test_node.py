"""The suite's one node: it registers Ready with a private address, runs a pod on the
pod network, from the node's local pause image, until the pod is deleted, and gives the
API server an address to reach a webhook behind a Service (``--enable-aggregator-routing``
dials the Service's endpoint, there being no kube-proxy).

These skip (saying why) where there is no node: see the ``node`` fixture.
"""

from __future__ import annotations

import ipaddress
import subprocess
import sys
import uuid

import pytest
from kubernetes import client

from kvstrata.operator import spec as S
from kvstrata.testing import pauseimage

from .conftest import ADMISSION, REPO, free_port

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


def chart_webhook(release: str, namespace: str) -> tuple[dict, dict]:
    """The chart's webhook Service and MutatingWebhookConfiguration, as it renders them."""
    import helm_python as helm
    import yaml

    manifests = helm.Chart.load(REPO / "charts" / "kvstrata").render(
        values={}, name=release, namespace=namespace
    )
    docs = [d for d in yaml.safe_load_all(manifests["kvstrata/templates/webhook.yaml"]) if d]
    service = next(d for d in docs if d["kind"] == "Service")
    config = next(d for d in docs if d["kind"] == "MutatingWebhookConfiguration")
    return service, config


def test_the_api_server_reaches_the_webhook_through_its_service_over_tls(
    kube, node, wait_for, tmp_path
):
    # The operator runs on this host, listening on every address, the node's included;
    # its Service has no selector and one endpoint, the node's address, as a pod's would be.
    suffix = uuid.uuid4().hex[:6]
    system, target = f"kvstrata-system-{suffix}", f"kvstrata-svc-{suffix}"
    service, config = chart_webhook(f"svc{suffix}", system)
    port = free_port()
    for name, labels in ((system, {}), (target, {"kvstrata.io/injection": "enabled"})):
        kube.apply(
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels}}
        )
    del service["spec"]["selector"]
    kube.apply(service)
    name = service["metadata"]["name"]
    core = client.CoreV1Api(kube.api)
    core.create_namespaced_endpoints(
        system,
        {
            "metadata": {"name": name},
            "subsets": [
                {
                    "addresses": [{"ip": node.pod_network.node_ip}],
                    "ports": [{"name": "https", "port": port}],
                }
            ],
        },
    )
    kube.apply(config)  # no caBundle yet: the operator puts its CA there
    log = tmp_path / "operator.log"
    args = [
        sys.executable,
        "-m",
        "kvstrata.cli",
        "operator",
        f"--watch-namespace={target}",
        f"--namespace={system}",
        f"--webhook-port={port}",
        f"--webhook-service={name}",
        f"--webhook-config={config['metadata']['name']}",
        f"--webhook-secret={name}-tls",
        f"--cert-dir={tmp_path / 'certs'}",
        "--liveness=",
        "--metrics-port=0",
    ]
    with log.open("wb") as out:
        operator = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        default_service_account(kube, target, wait_for)

        def answered() -> bool:
            # A pod naming a missing cache: the webhook marks it, when the API server reached it.
            probe = f"probe-{uuid.uuid4().hex[:6]}"
            created = kube.apply(
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {
                        "name": probe,
                        "namespace": target,
                        "annotations": {S.CACHE_ANNOTATION: "absent"},
                    },
                    "spec": stand_in_pod(probe, target)["spec"],
                }
            )
            kube.delete("v1", "Pod", target, probe)
            return S.SKIPPED_ANNOTATION in (created["metadata"].get("annotations") or {})

        wait_for(
            answered,
            POD_TIMEOUT_S,
            f"the API server to call the webhook through Service {system}/{name} "
            f"at {node.pod_network.node_ip}:{port}",
        )
        stored = kube.get(ADMISSION, "MutatingWebhookConfiguration", "", config["metadata"]["name"])
        assert stored["webhooks"][0]["clientConfig"]["service"]["name"] == name
        assert stored["webhooks"][0]["clientConfig"]["caBundle"]  # the operator's own CA
    finally:
        operator.terminate()
        operator.wait(timeout=30)
        kube.delete(ADMISSION, "MutatingWebhookConfiguration", "", config["metadata"]["name"])
        for namespace in (target, system):
            kube.delete("v1", "Namespace", "", namespace)
