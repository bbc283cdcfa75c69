"""Two operator replicas peering through kopf on the real API server: one reconciles, both admit.

The test creates the KopfPeering CRD and object itself (what a peering
install needs), starts two ``kvstrata operator --peering`` processes with
different priorities in a fresh namespace, waits until the lower one says it
paused, and then creates a KVCache: only the higher-priority replica counts a
reconcile on its /metrics, and both answer an admission review (kopf pauses
handlers, not its webhook server).
"""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
import urllib.request
import uuid

import pytest

from kvstrata.operator import certs
from kvstrata.operator import spec as S
from kvstrata.operator.webhook_tls import write_files

from .conftest import REPO, free_port
from .test_operator_on_cluster import kvcache

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

PEERING_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "kopfpeerings.kopf.dev"},
    "spec": {
        "group": "kopf.dev",
        "scope": "Namespaced",
        "names": {"kind": "KopfPeering", "plural": "kopfpeerings", "singular": "kopfpeering"},
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "x-kubernetes-preserve-unknown-fields": True,
                    }
                },
            }
        ],
    },
}


def reconciles(port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("kvstrata_operator_reconciles_total{")
    )


def admit(port: int, ca_file: str, namespace: str) -> dict:
    """One AdmissionReview for a pod that asks for no cache, to a replica's webhook."""
    review = {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "peering-review",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "operation": "CREATE",
            "namespace": namespace,
            "name": "plain",
            "userInfo": {"username": "test"},
            "object": {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "plain", "namespace": namespace},
                "spec": {"containers": [{"name": "c", "image": "registry.invalid/c:none"}]},
            },
            "dryRun": False,
        },
    }
    request = urllib.request.Request(
        f"https://127.0.0.1:{port}/inject",
        data=json.dumps(review).encode(),
        headers={"Content-Type": "application/json"},
    )
    context = ssl.create_default_context(cafile=ca_file)
    with urllib.request.urlopen(request, timeout=10, context=context) as answer:
        return json.loads(answer.read())["response"]


def _admitted(port: int, ca_file: str, namespace: str) -> dict | None:
    try:
        return admit(port, ca_file, namespace)
    except OSError:  # not listening yet
        return None


def test_of_two_peering_replicas_only_the_higher_priority_one_reconciles(
    kube, crd_applied, tmp_path, wait_for
):
    kube.apply(PEERING_CRD)
    wait_for(lambda: kube.has_kind("kopf.dev/v1", "KopfPeering"), 30, "the KopfPeering CRD")
    namespace = f"peering-{uuid.uuid4().hex[:6]}"
    kube.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
    from kubernetes import client

    peerings = client.CustomObjectsApi(kube.api)

    # A CRD just created is served a moment later: kopf's watch must not start before.
    def served() -> bool:
        try:
            peerings.list_namespaced_custom_object("kopf.dev", "v1", namespace, "kopfpeerings")
        except client.exceptions.ApiException:
            return False
        return True

    wait_for(served, 30, "kopfpeerings listed")
    peerings.create_namespaced_custom_object(
        "kopf.dev",
        "v1",
        namespace,
        "kopfpeerings",
        {
            "apiVersion": "kopf.dev/v1",
            "kind": "KopfPeering",
            "metadata": {"name": "kvstrata", "namespace": namespace},
        },
    )
    # Both replicas serve one certificate (as from the shared Secret).
    bundle = certs.issue(["127.0.0.1"])
    cert_dir = tmp_path / "certs"
    write_files(bundle, cert_dir)
    (tmp_path / "ca.crt").write_bytes(bundle.ca_crt)

    # A CRD just created may accept writes before its watches deliver them
    # (seen under load: kopf's watch stayed silent for a minute and neither
    # replica paused); start the replicas once a watch sees a change.
    def watch_delivers() -> bool:
        from kubernetes import watch

        found = peerings.get_namespaced_custom_object(
            "kopf.dev", "v1", namespace, "kopfpeerings", "kvstrata"
        )
        marker = {"metadata": {"labels": {"kvstrata.test/probe": uuid.uuid4().hex[:8]}}}
        peerings.patch_namespaced_custom_object(
            "kopf.dev", "v1", namespace, "kopfpeerings", "kvstrata", marker
        )
        stream = watch.Watch().stream(
            peerings.list_namespaced_custom_object,
            "kopf.dev",
            "v1",
            namespace,
            "kopfpeerings",
            resource_version=found["metadata"]["resourceVersion"],
            timeout_seconds=5,
        )
        return any(True for _ in stream)

    wait_for(watch_delivers, 120, "a watch on kopfpeerings delivering a change")
    replicas = []
    try:
        for priority in (2, 1):
            log = tmp_path / f"operator-{priority}.log"
            port = free_port()
            args = [sys.executable, "-m", "kvstrata.cli", "operator", "--watch-namespace"]
            args += [namespace, "--namespace", namespace, "--liveness", "", "--webhook-port"]
            args += [str(free_port()), "--cert-dir", str(cert_dir), "--cert-manager"]
            args += ["--metrics-port", str(port), "--peering", "kvstrata"]
            args += ["--priority", str(priority), "--verbose"]
            with log.open("wb") as out:
                process = subprocess.Popen(
                    args, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=dict(os.environ)
                )
            replicas.append((process, log, port, int(args[args.index("--webhook-port") + 1])))
        (_, _, high_port, high_hook), (_, low_log, low_port, low_hook) = replicas
        wait_for(
            lambda: "Pausing operations" in low_log.read_text(errors="replace"),
            60,
            "the lower-priority replica pausing in favour of the other",
        )
        kube.apply(kvcache("demo", namespace))

        def ready() -> bool:
            found = kube.get(S.API_VERSION, S.KIND, namespace, "demo") or {}
            conditions = (found.get("status") or {}).get("conditions") or []
            return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

        wait_for(ready, 90, "the KVCache Ready")
        assert reconciles(high_port) >= 1
        assert reconciles(low_port) == 0
        # The paused replica still answers admission requests, as the active one does.
        for hook in (low_hook, high_hook):
            answer = wait_for(
                lambda hook=hook: _admitted(hook, str(tmp_path / "ca.crt"), namespace),
                30,
                f"the webhook on port {hook}",
            )
            assert answer["uid"] == "peering-review" and answer["allowed"] is True
    finally:
        for process, log, _, _ in replicas:
            process.terminate()
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            print(f"{log.name}:\n{log.read_text(errors='replace')[-3000:]}")
        kube.delete("v1", "Namespace", "", namespace)
