"""A real cluster for the ``k8s`` suite, and the real operator running against it.

The cluster is the one ``KUBECONFIG`` (or ``~/.kube/config``) names; without
a reachable one every test here is skipped, saying so.

The operator runs out of cluster as ``python -m kvstrata.cli operator``,
watching one fresh namespace. For the admission tests the API server must
reach its webhook: set ``KVSTRATA_K8S_WEBHOOK_HOST`` to this machine's
address as the cluster sees it (kind/Docker: ``172.17.0.1`` or
``host.docker.internal``); the test then issues a certificate for that host
and registers a MutatingWebhookConfiguration with a URL. Without it the
admission tests are skipped, saying so.
"""

from __future__ import annotations

import base64
import os
import socket
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvstrata.sidecarproc import wait_until

REPO = Path(__file__).resolve().parents[2]
ADMISSION = "admissionregistration.k8s.io/v1"


def wait_for(condition: Callable[[], Any], timeout: float, what: str, step: float = 0.5) -> Any:
    """Poll ``condition`` until it returns something truthy, or fail naming ``what``."""
    return wait_until(condition, timeout, what, step=step, error=pytest.fail.Exception)


@pytest.fixture(name="wait_for")
def wait_for_fixture() -> Callable[..., Any]:
    return wait_for


def _reachable_cluster():
    try:
        from kubernetes import client, config

        try:
            config.load_kube_config()
        except Exception:
            config.load_incluster_config()
        api = client.ApiClient()
        client.VersionApi(api).get_code(_request_timeout=5)
    except Exception as exc:
        return None, f"no reachable Kubernetes cluster ({type(exc).__name__}: {exc})"
    from kvstrata.operator.kube import KubeCluster

    return KubeCluster(api), ""


@pytest.fixture(scope="session")
def kube():
    cluster, why = _reachable_cluster()
    if cluster is None:
        pytest.skip(why)
    return cluster


@pytest.fixture(scope="session")
def crd_applied(kube):
    crd = yaml.safe_load((REPO / "crds" / "kvcache.yaml").read_text())
    kube.apply(crd)

    def established():
        found = kube.get(
            "apiextensions.k8s.io/v1", "CustomResourceDefinition", "", crd["metadata"]["name"]
        )
        conditions = ((found or {}).get("status") or {}).get("conditions") or []
        return any(c["type"] == "Established" and c["status"] == "True" for c in conditions)

    wait_for(established, 60, "the KVCache CRD to be established")
    return crd


@pytest.fixture(scope="session")
def namespace(kube, crd_applied) -> Iterator[str]:
    name = f"kvstrata-test-{uuid.uuid4().hex[:6]}"
    kube.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    yield name
    kube.delete("v1", "Namespace", "", name)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def webhook(kube, namespace, tmp_path_factory) -> Iterator[dict[str, Any] | None]:
    """Certificate files and a registered webhook, when the API server can reach us."""
    host = os.environ.get("KVSTRATA_K8S_WEBHOOK_HOST")
    if not host:
        yield None
        return
    from kvstrata.operator import certs
    from kvstrata.operator.webhook_tls import write_files

    port = _free_port()
    cert_dir = tmp_path_factory.mktemp("webhook")
    bundle = certs.issue([host])
    write_files(bundle, cert_dir)
    name = f"{namespace}-inject"
    kube.apply(
        {
            "apiVersion": ADMISSION,
            "kind": "MutatingWebhookConfiguration",
            "metadata": {"name": name},
            "webhooks": [
                {
                    "name": "inject.kvstrata.io",
                    "admissionReviewVersions": ["v1"],
                    "failurePolicy": "Ignore",
                    "sideEffects": "None",
                    "timeoutSeconds": 5,
                    "clientConfig": {
                        "url": f"https://{host}:{port}/inject",
                        "caBundle": base64.b64encode(bundle.ca_crt).decode(),
                    },
                    "rules": [
                        {
                            "apiGroups": [""],
                            "apiVersions": ["v1"],
                            "operations": ["CREATE"],
                            "resources": ["pods"],
                        }
                    ],
                    "namespaceSelector": {
                        "matchLabels": {"kubernetes.io/metadata.name": namespace}
                    },
                }
            ],
        }
    )
    yield {"port": port, "cert_dir": cert_dir, "config": name}
    kube.delete(ADMISSION, "MutatingWebhookConfiguration", "", name)


@pytest.fixture(scope="session")
def operator(kube, namespace, webhook, tmp_path_factory) -> Iterator[subprocess.Popen]:
    log = tmp_path_factory.mktemp("operator") / "operator.log"
    args = [
        sys.executable,
        "-m",
        "kvstrata.cli",
        "operator",
        "--watch-namespace",
        namespace,
        "--namespace",
        namespace,
        "--liveness",
        "",
    ]
    if webhook is None:
        args += ["--webhook-port", "0"]
    else:
        # Certificates are provided (as cert-manager would): the operator only serves them.
        args += [
            "--webhook-port",
            str(webhook["port"]),
            "--cert-dir",
            str(webhook["cert_dir"]),
            "--cert-manager",
        ]
    with log.open("wb") as out:
        process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    yield process
    process.terminate()
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    if process.returncode not in (0, -15):
        print(log.read_text()[-4000:])
