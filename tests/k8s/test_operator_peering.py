"""Two operator replicas peering through kopf on the real API server: one reconciles, both admit.

The test installs kopf's peering CRDs as the chart ships them and a
KopfPeering as the chart renders it for a watched namespace, starts two
``kvstrata operator --peering`` processes with different priorities, and
creates a KVCache: only the higher-priority replica counts a reconcile on its
/metrics, both answer an admission review (kopf pauses handlers, not its
webhook server), and once the higher one stops the other takes over.

The replicas start one after the other, the lower one once the higher one's
keep-alive is stored. kopf starts a peering replica paused and logs
"Pausing operations" only when an active replica pauses, so a replica whose
first view of the peering already holds a live higher-priority peer stays
paused without a word; a wait for that line failed whenever the second
replica listed the peering after the first one's keep-alive (at 1.29.4, 2
runs of 2 on the merged tree). Started in this order, the lower replica is
never active, whatever the timing (tests/operator/test_peering_model.py
shows both orders on kopf's own peering code).
"""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest

from kvstrata.operator import certs
from kvstrata.operator import spec as S
from kvstrata.operator.webhook_tls import write_files
from kvstrata.testing.processes import stop_process

from .conftest import REPO, free_port
from .test_operator_on_cluster import kvcache

pytestmark = [pytest.mark.k8s, pytest.mark.slow]
PEERING = "kvstrata"


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


def keep_alives(kube: Any, namespace: str) -> dict[str, dict[str, Any]]:
    """The peers' entries in the KopfPeering's status, by identity."""
    from kubernetes import client

    found = client.CustomObjectsApi(kube.api).get_namespaced_custom_object(
        "kopf.dev", "v1", namespace, "kopfpeerings", PEERING
    )
    return found.get("status") or {}


def has_priority(kube: Any, namespace: str, priority: int) -> bool:
    return any(e.get("priority") == priority for e in keep_alives(kube, namespace).values())


def start_replica(
    tmp_path: Path, namespace: str, cert_dir: Path, priority: int
) -> tuple[subprocess.Popen, Path, int, int]:
    """``kvstrata operator --peering`` at ``priority``: process, log, metrics and webhook ports."""
    log = tmp_path / f"operator-{priority}.log"
    metrics, hook = free_port(), free_port()
    args = [sys.executable, "-m", "kvstrata.cli", "operator", "--watch-namespace", namespace]
    args += ["--namespace", namespace, "--liveness", "", "--webhook-port", str(hook)]
    args += ["--cert-dir", str(cert_dir), "--cert-manager", "--metrics-port", str(metrics)]
    args += ["--peering", PEERING, "--priority", str(priority), "--verbose"]
    with log.open("wb") as out:
        process = subprocess.Popen(
            args, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=dict(os.environ)
        )
    return process, log, metrics, hook


def test_of_two_peering_replicas_only_the_higher_priority_one_reconciles(
    kube, crd_applied, peering_crds, tmp_path, wait_for
):
    namespace = f"peering-{uuid.uuid4().hex[:6]}"
    kube.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
    from kubernetes import client

    client.CustomObjectsApi(kube.api).create_namespaced_custom_object(
        "kopf.dev",
        "v1",
        namespace,
        "kopfpeerings",
        {
            "apiVersion": "kopf.dev/v1",
            "kind": "KopfPeering",
            "metadata": {"name": PEERING, "namespace": namespace},
        },
    )
    # Both replicas serve one certificate (as from the shared Secret).
    bundle = certs.issue(["127.0.0.1"])
    cert_dir = tmp_path / "certs"
    write_files(bundle, cert_dir)
    (tmp_path / "ca.crt").write_bytes(bundle.ca_crt)

    replicas = []
    try:
        replicas.append(start_replica(tmp_path, namespace, cert_dir, priority=2))
        wait_for(lambda: has_priority(kube, namespace, 2), 60, "the first replica's keep-alive")
        replicas.append(start_replica(tmp_path, namespace, cert_dir, priority=1))
        wait_for(lambda: has_priority(kube, namespace, 1), 60, "the second replica's keep-alive")
        (high, _, high_port, high_hook), (_, low_log, low_port, low_hook) = replicas
        kube.apply(kvcache("demo", namespace))

        def ready() -> bool:
            found = kube.get(S.API_VERSION, S.KIND, namespace, "demo") or {}
            conditions = (found.get("status") or {}).get("conditions") or []
            return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

        wait_for(ready, 90, "the KVCache Ready")
        assert reconciles(high_port) >= 1
        assert reconciles(low_port) == 0
        assert "Resuming operations" not in low_log.read_text(errors="replace")
        # The paused replica still answers admission requests, as the active one does.
        for hook in (low_hook, high_hook):
            answer = wait_for(
                lambda hook=hook: _admitted(hook, str(tmp_path / "ca.crt"), namespace),
                30,
                f"the webhook on port {hook}",
            )
            assert answer["uid"] == "peering-review" and answer["allowed"] is True

        # The higher replica goes (its farewell takes its keep-alive out): the other
        # takes over and reconciles the KVCache it had left alone.
        stop_process(high)
        assert not has_priority(kube, namespace, 2)
        wait_for(lambda: reconciles(low_port) >= 1, 60, "the remaining replica reconciling")
    finally:
        for process, log, _, _ in replicas:
            code = stop_process(process)
            print(f"{log.name} (exit {code}):\n{log.read_text(errors='replace')[-3000:]}")
        kube.delete("v1", "Namespace", "", namespace)
