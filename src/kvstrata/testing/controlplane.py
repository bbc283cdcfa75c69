"""A Kubernetes control plane on loopback for the ``k8s`` suite: etcd, kube-apiserver and
(when present) kube-controller-manager, kube-scheduler and one node.

Why this module exists: the ``k8s`` suite needs a real API server (the
refusals that matter are its own), and a user with the envtest binaries
should get one with nothing else to set up. The convention is envtest's:
``KUBEBUILDER_ASSETS`` names a folder holding ``etcd`` and ``kube-apiserver``
and optionally ``kube-controller-manager`` (``setup-envtest use -p path``
prints such a folder). Without the controller manager there is no garbage
collection, no Deployment controller and no ``default`` service account;
the suite then disables the ServiceAccount admission plugin (pods need the
account to exist) and skips the tests that need the controllers, saying so.
With ``kube-scheduler`` and ``kubelet`` in the folder too, and a machine
that can run a node (:func:`node_unavailable` says why not), the control
plane gets one node (:mod:`kvstrata.testing.node`), stopped before it.

Everything lives in one temporary folder and listens on 127.0.0.1 only, on
free ports: a CA and a serving certificate (the API server's
``--tls-cert-file``) for 127.0.0.1 and for the ``kubernetes`` Service's
ClusterIP and DNS names (the node's pods reach the API server there,
:mod:`kvstrata.testing.apiroute`), a static token for one ``system:masters`` user
(``--token-auth-file``, RBAC authorisation), a service-account signing key,
and a kubeconfig for the clients. The flags are kube-apiserver's and
kube-controller-manager's documented ones
(https://kubernetes.io/docs/reference/command-line-tools-reference/kube-apiserver/,
.../kube-controller-manager/) and etcd's
(https://etcd.io/docs/v3.5/op-guide/configuration/), the same in every
version from 1.29 on and in etcd 3.4 and 3.5.
"""

from __future__ import annotations

import ipaddress
import json
import os
import secrets
import socket
import ssl
import subprocess
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kvstrata.testing.node import Node, NodeError, missing_tools
from kvstrata.testing.processes import ProcessSet

ASSETS_ENV = "KUBEBUILDER_ASSETS"
ADMIN_USER = "kvstrata-admin"
SERVICE_CLUSTER_IP_RANGE = "10.0.0.0/24"
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"
# The kubernetes Service gets the range's first address; in-cluster clients dial it.
API_SERVICE_IP = str(next(ipaddress.ip_network(SERVICE_CLUSTER_IP_RANGE).hosts()))
API_SERVICE_NAMES = (
    API_SERVICE_IP,
    "kubernetes",
    "kubernetes.default",
    "kubernetes.default.svc",
    "kubernetes.default.svc.cluster.local",
)


class ControlPlaneError(RuntimeError):
    """The control plane cannot be had: the message names what is missing or what failed."""


@dataclass(frozen=True, slots=True)
class Assets:
    etcd: Path
    kube_apiserver: Path
    kube_controller_manager: Path | None
    kube_scheduler: Path | None = None
    kubelet: Path | None = None

    @property
    def node_missing(self) -> list[str]:
        """What the folder lacks for a one-node cluster (empty when it has it all)."""
        wanted = {
            "kube-controller-manager": self.kube_controller_manager,
            "kube-scheduler": self.kube_scheduler,
            "kubelet": self.kubelet,
        }
        return [name for name, path in wanted.items() if path is None]


def find_assets(environ: Mapping[str, str] | None = None) -> Assets | None:
    """The binaries ``KUBEBUILDER_ASSETS`` names; None when it is not set.

    Raises :class:`ControlPlaneError` when it is set but lacks a required
    binary: a user who pointed at a folder wants to know it is the wrong one.
    """
    env = os.environ if environ is None else environ
    folder = env.get(ASSETS_ENV)
    if not folder:
        return None
    root = Path(folder)

    def binary(name: str) -> Path | None:
        path = root / name
        return path if path.is_file() and os.access(path, os.X_OK) else None

    etcd, apiserver = binary("etcd"), binary("kube-apiserver")
    missing = [n for n, p in (("etcd", etcd), ("kube-apiserver", apiserver)) if p is None]
    if missing:
        raise ControlPlaneError(
            f"{ASSETS_ENV}={folder} has no executable {' or '.join(missing)} "
            "(it should name a folder holding etcd, kube-apiserver and optionally "
            "kube-controller-manager)"
        )
    assert etcd is not None and apiserver is not None
    return Assets(
        etcd,
        apiserver,
        binary("kube-controller-manager"),
        binary("kube-scheduler"),
        binary("kubelet"),
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Files:
    """What the processes and clients read, written into ``root`` by :meth:`write`."""

    root: Path
    token: str = field(default_factory=lambda: secrets.token_hex(24))

    @property
    def ca(self) -> Path:
        return self.root / "ca.crt"

    @property
    def serving_cert(self) -> Path:
        return self.root / "apiserver.crt"

    @property
    def serving_key(self) -> Path:
        return self.root / "apiserver.key"

    @property
    def token_file(self) -> Path:
        return self.root / "tokens.csv"

    @property
    def sa_key(self) -> Path:
        return self.root / "sa.key"

    @property
    def sa_pub(self) -> Path:
        return self.root / "sa.pub"

    @property
    def kubeconfig(self) -> Path:
        return self.root / "kubeconfig"

    def write(self, server: str) -> None:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import rsa

        from kvstrata.operator import certs

        self.root.mkdir(parents=True, exist_ok=True)
        # The Service names and ClusterIP too: the node's pods verify the API
        # server at the kubernetes Service (kvstrata.testing.apiroute).
        bundle = certs.issue(["127.0.0.1", "localhost", *API_SERVICE_NAMES])
        self.ca.write_bytes(bundle.ca_crt)
        self.serving_cert.write_bytes(bundle.tls_crt)
        _write_private(self.serving_key, bundle.tls_key)
        # --token-auth-file: token,user,uid,"group1,group2"; system:masters is
        # allowed everything by RBAC without any binding.
        _write_private(self.token_file, f'{self.token},{ADMIN_USER},1,"system:masters"\n'.encode())
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        _write_private(
            self.sa_key,
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.TraditionalOpenSSL,
                serialization.NoEncryption(),
            ),
        )
        self.sa_pub.write_bytes(
            key.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        )
        self.kubeconfig.write_text(kubeconfig_text(server, self.ca, self.token))


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)


def kubeconfig_text(server: str, ca: Path, token: str) -> str:
    """A kubeconfig (JSON is YAML) for ``server``, trusting ``ca``, with a bearer token."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "loopback", "cluster": {"server": server, "certificate-authority": str(ca)}}
        ],
        "users": [{"name": ADMIN_USER, "user": {"token": token}}],
        "contexts": [{"name": "loopback", "context": {"cluster": "loopback", "user": ADMIN_USER}}],
        "current-context": "loopback",
    }
    return json.dumps(config, indent=2)


def etcd_args(binary: Path, data_dir: Path, client_port: int, peer_port: int) -> list[str]:
    client, peer = f"http://127.0.0.1:{client_port}", f"http://127.0.0.1:{peer_port}"
    return [
        str(binary),
        "--data-dir",
        str(data_dir),
        "--listen-client-urls",
        client,
        "--advertise-client-urls",
        client,
        "--listen-peer-urls",
        peer,
        "--initial-advertise-peer-urls",
        peer,
        "--initial-cluster",
        f"default={peer}",  # the member's --name defaults to "default"
    ]


def apiserver_args(
    binary: Path, files: Files, etcd_url: str, port: int, service_account_admission: bool
) -> list[str]:
    args = [
        str(binary),
        f"--etcd-servers={etcd_url}",
        "--bind-address=127.0.0.1",
        "--advertise-address=127.0.0.1",
        f"--secure-port={port}",
        f"--cert-dir={files.root / 'apiserver-certs'}",
        f"--tls-cert-file={files.serving_cert}",
        f"--tls-private-key-file={files.serving_key}",
        f"--token-auth-file={files.token_file}",
        "--authorization-mode=RBAC",
        f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
        f"--service-account-key-file={files.sa_pub}",
        f"--service-account-signing-key-file={files.sa_key}",
        f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
        "--allow-privileged=true",
        # Webhooks (and aggregated APIs) behind a Service are dialled at an
        # endpoint's pod IP, not the ClusterIP: no kube-proxy runs here.
        "--enable-aggregator-routing=true",
        # The node's name resolves nowhere: logs, exec and port-forward dial its address.
        "--kubelet-preferred-address-types=InternalIP",
    ]
    if not service_account_admission:
        # No controller manager, no "default" service account: the plugin
        # would refuse every pod that names none.
        args.append("--disable-admission-plugins=ServiceAccount")
    return args


def controller_manager_args(binary: Path, files: Files) -> list[str]:
    return [
        str(binary),
        f"--kubeconfig={files.kubeconfig}",
        "--leader-elect=false",
        "--controllers=*",
        f"--service-account-private-key-file={files.sa_key}",
        f"--root-ca-file={files.ca}",
        "--bind-address=127.0.0.1",
        "--secure-port=0",  # serves nothing: the suite only needs its controllers
    ]


def scheduler_args(binary: Path, files: Files) -> list[str]:
    return [
        str(binary),
        f"--kubeconfig={files.kubeconfig}",
        "--leader-elect=false",
        "--bind-address=127.0.0.1",
        "--secure-port=0",  # serves nothing: the suite reads pods' status, not its metrics
    ]


def node_unavailable(assets: Assets) -> str | None:
    """Why this machine and folder give no node; None when they do."""
    if assets.node_missing:
        return f"{ASSETS_ENV} has no {', '.join(assets.node_missing)}"
    if os.geteuid() != 0:
        return "a node (containerd, kubelet, mounts, cgroups, a bridge) needs root"
    missing = missing_tools()
    if missing:
        return f"this machine lacks {', '.join(missing)}"
    return None


class ControlPlane:
    """Start with :meth:`start`, which returns the kubeconfig path; :meth:`stop` ends it all."""

    def __init__(self, assets: Assets, workdir: Path) -> None:
        self.assets = assets
        self.workdir = workdir
        self.files = Files(workdir / "pki")
        self.running = ProcessSet(workdir, ControlPlaneError)
        self.server = ""
        self.node: Node | None = None
        # Why there is no node, for the tests that need one to say when they skip.
        self.no_node_reason = node_unavailable(assets)

    @property
    def processes(self) -> list[tuple[str, subprocess.Popen]]:
        return self.running.processes

    @property
    def has_controller_manager(self) -> bool:
        return self.assets.kube_controller_manager is not None

    def log_tail(self, name: str, size: int = 3000) -> str:
        return self.running.log_tail(name, size)

    def start_etcd(self, timeout: float = 60) -> str:
        client_port, peer_port = free_port(), free_port()
        data = self.workdir / "etcd-data"
        args = etcd_args(self.assets.etcd, data, client_port, peer_port)
        process = self.running.spawn("etcd", args)
        url = f"http://127.0.0.1:{client_port}"

        def healthy() -> bool:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as answer:
                return json.loads(answer.read()).get("health") == "true"

        self.running.wait("etcd", process, healthy, timeout)
        return url

    def start(self, timeout: float = 120) -> Path:
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            etcd_url = self.start_etcd()
            port = free_port()
            self.server = f"https://127.0.0.1:{port}"
            self.files.write(self.server)
            args = apiserver_args(
                self.assets.kube_apiserver, self.files, etcd_url, port, self.has_controller_manager
            )
            process = self.running.spawn("kube-apiserver", args)
            self.running.wait("kube-apiserver", process, self._api_ready, timeout)
            if self.assets.kube_controller_manager is not None:
                self.running.spawn(
                    "kube-controller-manager",
                    controller_manager_args(self.assets.kube_controller_manager, self.files),
                )
            if self.assets.kube_scheduler is not None:
                self.running.spawn(
                    "kube-scheduler", scheduler_args(self.assets.kube_scheduler, self.files)
                )
            if self.no_node_reason is None and self.assets.kubelet is not None:
                self.node = Node(
                    self.assets.kubelet,
                    self.workdir / "node",
                    self.files.kubeconfig,
                    self._node_ready,
                    api_service=(API_SERVICE_IP, port),
                )
                try:
                    self.node.start()
                except NodeError as exc:
                    raise ControlPlaneError(f"the node did not start: {exc}") from exc
        except BaseException:
            self.stop()
            raise
        return self.files.kubeconfig

    def _api_ready(self) -> bool:
        context = ssl.create_default_context(cafile=str(self.files.ca))
        request = urllib.request.Request(
            f"{self.server}/readyz", headers={"Authorization": f"Bearer {self.files.token}"}
        )
        try:
            with urllib.request.urlopen(request, timeout=2, context=context) as answer:
                return answer.status == 200
        except urllib.error.HTTPError:
            return False  # 500 while its post-start hooks run

    def _get(self, path: str) -> dict | None:
        """GET ``path`` from the API server as the admin; None for 404."""
        context = ssl.create_default_context(cafile=str(self.files.ca))
        request = urllib.request.Request(
            f"{self.server}{path}", headers={"Authorization": f"Bearer {self.files.token}"}
        )
        try:
            with urllib.request.urlopen(request, timeout=5, context=context) as answer:
                return json.loads(answer.read())
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise

    def _node_ready(self, name: str) -> bool:
        found = self._get(f"/api/v1/nodes/{name}") or {}
        conditions = (found.get("status") or {}).get("conditions") or []
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

    def stop(self) -> None:
        """Stop the node (it needs the API server no more), then the control plane's
        processes, newest first (the controller manager before its server)."""
        try:
            if self.node is not None:
                self.node.stop()
                self.node = None
        finally:
            self.running.stop()
