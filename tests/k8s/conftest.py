"""A real cluster for the ``k8s`` suite, and the real operator running against it.

The cluster, in this order:

1. a control plane of its own on loopback when ``KUBEBUILDER_ASSETS`` names
   a folder with ``etcd`` and ``kube-apiserver`` (and optionally
   ``kube-controller-manager``), the envtest convention
   (:mod:`kvstrata.testing.controlplane`); it is started once per session,
   ``KUBECONFIG`` is pointed at it for the session, and it is stopped at
   the end;
2. else the one the kubeconfig names (``$KUBECONFIG``, else
   ``~/.kube/config``), or the pod's service account when the suite runs in
   one: the same rules the operator follows
   (:func:`kvstrata.operator.kube.client_configuration`).

The suite is skipped only when none of these is there, saying so; a
``KUBEBUILDER_ASSETS`` folder without the binaries, a control plane that
does not start, or a configured cluster that cannot be reached or refuses
the credentials fails every test.

When the ``KUBEBUILDER_ASSETS`` folder also holds ``kube-scheduler`` and
``kubelet`` and the machine has containerd, runc, the CNI plugins and root,
the control plane gets one node (:mod:`kvstrata.testing.node`) and the
tests that run pods (the ``node`` fixture) run; otherwise they skip, saying
which of these is missing. Every other test passes against a control plane
with no nodes at all (etcd + kube-apiserver + kube-controller-manager).

The operator runs out of cluster as ``python -m kvstrata.cli operator``,
watching one fresh namespace, with the webhook on this machine. The API
server must reach it: when the API server's address is on loopback the
webhook is registered at ``https://127.0.0.1:PORT``; otherwise set
``KVSTRATA_K8S_WEBHOOK_HOST`` to this machine's address as the cluster sees
it (kind/Docker: ``172.17.0.1`` or ``host.docker.internal``; kind also
needs it although its kubeconfig says 127.0.0.1, since its API server runs
in a container). Without either, the admission tests are skipped, saying so.
"""

from __future__ import annotations

import base64
import ipaddress
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import urllib.parse
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvstrata.testing import nodeclean
from kvstrata.testing.controlplane import ASSETS_ENV, ControlPlane, ControlPlaneError, find_assets
from kvstrata.testing.poll import wait_until
from kvstrata.testing.processes import stop_process

REPO = Path(__file__).resolve().parents[2]
ADMISSION = "admissionregistration.k8s.io/v1"
WEBHOOK_HOST_ENV = "KVSTRATA_K8S_WEBHOOK_HOST"


def wait_for(condition: Callable[[], Any], timeout: float, what: str, step: float = 0.5) -> Any:
    """Poll ``condition`` until it returns something truthy, or fail naming ``what``."""
    return wait_until(condition, timeout, what, step=step, error=pytest.fail.Exception)


@pytest.fixture(name="wait_for")
def wait_for_fixture() -> Callable[..., Any]:
    return wait_for


@pytest.fixture(scope="session")
def own_control_plane() -> Iterator[ControlPlane | None]:
    """The loopback control plane ``KUBEBUILDER_ASSETS`` asks for (None when it does not)."""
    try:
        assets = find_assets()
    except ControlPlaneError as exc:
        pytest.fail(str(exc))
    if assets is None:
        yield None
        return
    # Not under pytest's temporary folder: a pytest run of the same user elsewhere on the
    # machine keeps only the three newest of those, and deleted a running suite's etcd
    # data and CA (seen: the API server answered 504, then the CA file was gone).
    workdir = Path(tempfile.mkdtemp(prefix="kvstrata-control-plane-"))
    try:
        yield from _running_control_plane(assets, workdir)
    finally:
        if not nodeclean.mounts_under(workdir):  # never delete through a mount left behind
            shutil.rmtree(workdir, ignore_errors=True)


def _running_control_plane(assets: Any, workdir: Path) -> Iterator[ControlPlane]:
    plane = ControlPlane(assets, workdir)
    try:
        kubeconfig = plane.start()
    except ControlPlaneError as exc:
        pytest.fail(f"the control plane from {ASSETS_ENV} did not start: {exc}")
    before = os.environ.get("KUBECONFIG")
    os.environ["KUBECONFIG"] = str(kubeconfig)  # for this process and the operator it starts
    try:
        yield plane
    finally:
        if before is None:
            os.environ.pop("KUBECONFIG", None)
        else:
            os.environ["KUBECONFIG"] = before
        plane.stop()


@pytest.fixture(scope="session")
def controllers(own_control_plane) -> None:
    """Skip (saying why) where the suite's own control plane runs no controller manager."""
    if own_control_plane is not None and not own_control_plane.has_controller_manager:
        pytest.skip(
            f"{ASSETS_ENV} has no kube-controller-manager: no garbage collector or "
            "Deployment controller on this control plane"
        )


@pytest.fixture(scope="session")
def node(own_control_plane):
    """The suite's own node (:class:`kvstrata.testing.node.Node`); skip, saying why, without."""
    if own_control_plane is None:
        pytest.skip(
            f"no node of the suite's own: {ASSETS_ENV} is not set (a configured cluster's "
            "nodes cannot load the suite's local images)"
        )
    if own_control_plane.node is None:
        pytest.skip(f"no node: {own_control_plane.no_node_reason}")
    return own_control_plane.node


@pytest.fixture(scope="session")
def kube_configuration(own_control_plane) -> Any:
    """The client configuration of the configured cluster; skip only when there is none."""
    from kvstrata.operator import kube

    if not kube.cluster_configured():
        pytest.skip(
            "no Kubernetes cluster: KUBEBUILDER_ASSETS names no folder with etcd and "
            "kube-apiserver, and none is configured (no $KUBECONFIG, no ~/.kube/config, "
            "not in a pod with a service account)"
        )
    try:
        return kube.client_configuration()
    except Exception as exc:  # a configured cluster that fails is a failure
        pytest.fail(f"the configured cluster's kubeconfig is unusable: {exc}")


@pytest.fixture(scope="session")
def kube(kube_configuration):
    from kubernetes import client

    from kvstrata.operator.kube import KubeCluster

    api = client.ApiClient(kube_configuration)
    try:
        version = client.VersionApi(api).get_code(_request_timeout=10)
    except Exception as exc:
        pytest.fail(
            f"the configured cluster at {kube_configuration.host} does not answer /version: "
            f"{type(exc).__name__}: {exc}"
        )
    print(f"k8s suite: {kube_configuration.host}, Kubernetes {version.git_version}")
    return KubeCluster(api)


@pytest.fixture(scope="session")
def native_sidecars(kube) -> bool:
    """Does this API server run native sidecars (1.29 or later), as the operator decides it?"""
    from kvstrata.operator.serverversion import parse_version

    return parse_version(kube.server_version()).native_sidecars


def api_server_on_loopback(configuration: Any) -> bool:
    host = urllib.parse.urlsplit(configuration.host).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@pytest.fixture(scope="session")
def crd_applied(kube):
    crd = yaml.safe_load((REPO / "crds" / "kvcache.yaml").read_text())
    kube.apply(crd)  # refused here when the API server rejects the CRD

    def established():
        found = kube.get(
            "apiextensions.k8s.io/v1", "CustomResourceDefinition", "", crd["metadata"]["name"]
        )
        conditions = ((found or {}).get("status") or {}).get("conditions") or []
        return any(c["type"] == "Established" and c["status"] == "True" for c in conditions)

    wait_for(established, 60, "the KVCache CRD to be established")
    return crd


@pytest.fixture(scope="session")
def peering_crds(kube) -> list[dict[str, Any]]:
    """kopf's peering CRDs as the chart ships them (``crds/kopfpeering.yaml``), served."""
    crds = list(yaml.safe_load_all((REPO / "crds" / "kopfpeering.yaml").read_text()))
    for crd in crds:
        kube.apply(crd)  # refused here when the API server rejects the CRD
    from kubernetes import client

    objects = client.CustomObjectsApi(kube.api)

    # A CRD just created is served a moment after it is established: wait
    # until each kind can be listed, or a watch started now might miss writes.
    def served() -> bool:
        try:
            objects.list_cluster_custom_object("kopf.dev", "v1", "clusterkopfpeerings")
            objects.list_cluster_custom_object("kopf.dev", "v1", "kopfpeerings")
        except client.exceptions.ApiException:
            return False
        return True

    wait_for(served, 60, "kopf's peering kinds served")
    return crds


@pytest.fixture(scope="session")
def namespace(kube, crd_applied) -> Iterator[str]:
    name = f"kvstrata-test-{uuid.uuid4().hex[:6]}"
    kube.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    yield name
    kube.delete("v1", "Namespace", "", name)


def free_port() -> int:
    """A TCP port nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        return s.getsockname()[1]


def chart_webhook_values() -> dict[str, Any]:
    """failurePolicy and timeoutSeconds as the chart registers the webhook."""
    values = yaml.safe_load((REPO / "charts" / "kvstrata" / "values.yaml").read_text())
    return values["webhook"]


def webhook_configuration(
    name: str,
    url: str,
    ca_crt: bytes,
    namespace: str,
    object_selector: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A MutatingWebhookConfiguration for pod CREATE in ``namespace``, with the chart's policy."""
    chart = chart_webhook_values()
    hook: dict[str, Any] = {
        "name": "inject.kvstrata.io",
        "admissionReviewVersions": ["v1"],
        "failurePolicy": chart["failurePolicy"],
        "sideEffects": "None",
        "timeoutSeconds": chart["timeoutSeconds"],
        "clientConfig": {"url": url, "caBundle": base64.b64encode(ca_crt).decode()},
        "rules": [
            {
                "apiGroups": [""],
                "apiVersions": ["v1"],
                "operations": ["CREATE"],
                "resources": ["pods"],
            }
        ],
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
    }
    if object_selector is not None:
        hook["objectSelector"] = object_selector
    return {
        "apiVersion": ADMISSION,
        "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": name},
        "webhooks": [hook],
    }


@pytest.fixture(scope="session")
def webhook_host(kube_configuration) -> str | None:
    """Where the API server reaches this machine, or None when that is not known."""
    host = os.environ.get(WEBHOOK_HOST_ENV)
    if host:
        return host
    return "127.0.0.1" if api_server_on_loopback(kube_configuration) else None


@pytest.fixture(scope="session")
def webhook(kube, namespace, webhook_host, tmp_path_factory) -> Iterator[dict[str, Any] | None]:
    """Certificate files and a registered webhook, when the API server can reach us."""
    if webhook_host is None:
        yield None
        return
    from kvstrata.operator import certs
    from kvstrata.operator.webhook_tls import write_files

    port = free_port()
    cert_dir = tmp_path_factory.mktemp("webhook")
    bundle = certs.issue([webhook_host])
    write_files(bundle, cert_dir)
    name = f"{namespace}-inject"
    url = f"https://{webhook_host}:{port}/inject"
    kube.apply(webhook_configuration(name, url, bundle.ca_crt, namespace))
    yield {"port": port, "cert_dir": cert_dir, "config": name, "url": url, "ca": bundle.ca_crt}
    kube.delete(ADMISSION, "MutatingWebhookConfiguration", "", name)


@dataclass(frozen=True)
class RunningOperator:
    process: subprocess.Popen
    log: Path

    def tail(self, size: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-size:]


@pytest.fixture(scope="session")
def operator(kube, namespace, webhook, tmp_path_factory) -> Iterator[RunningOperator]:
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
    running = RunningOperator(process, log)
    yield running
    code = stop_process(process)
    print(f"operator exited {code}; last lines of its log:\n{running.tail()}")
