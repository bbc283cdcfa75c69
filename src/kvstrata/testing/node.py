"""One node for the suite's control plane: containerd, a kubelet and a pod network, in a
temporary folder, all removed again by :meth:`Node.stop` (also after a failed start).

Why this module exists: an injected pod is only proven by running it (the
native sidecar's start order, its probes, the shared volumes, the
read-only root filesystem); a control plane without nodes leaves every pod
Pending. The node needs, besides the kubelet from ``KUBEBUILDER_ASSETS``:
``containerd``, ``ctr`` and ``runc`` (Debian's ``containerd`` and ``runc``),
the CNI plugins ``bridge``, ``host-local`` and ``loopback`` (Debian's
``containernetworking-plugins``), ``ip`` (``iproute2``) and a C compiler for
the pause image (:mod:`kvstrata.testing.pauseimage`); :func:`missing_tools`
names what this machine lacks. It runs as root (mounts, cgroups, network).

What it sets, and why:

- containerd with its own root, state, socket and plugin folders, cgroupfs
  (no systemd here), ``restrict_oom_score_adj`` (without CAP_SYS_RESOURCE,
  as in a VM's or CI's root, runc cannot lower a container's OOM score and
  every pod fails), the local pause image as the sandbox image, network
  namespaces under its state folder, CNI from :mod:`kvstrata.testing.nodenet`;
- a kubelet (``KubeletConfiguration`` v1beta1) with its own root, pod-log and
  certificate folders, a cgroup root of its own (``/kvstrata-<id>`` in every
  hierarchy), ``failCgroupV1: false`` (cgroup v1 machines still work; the
  newest kubelets refuse them by default; 1.29 ignores the field), swap tolerated, eviction and
  image GC thresholds low enough that a full shared disk does not evict the
  suite's pods, and its API (port, node IP only) open to the API server
  without client certificates: the address is a private bridge address this
  host alone reaches.
"""

from __future__ import annotations

import json
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvstrata.testing import nodeclean, pauseimage
from kvstrata.testing.apiroute import ApiServiceRoute
from kvstrata.testing.nodenet import NodeNetwork, PodNetwork, cni_bin_dir
from kvstrata.testing.processes import ProcessSet

# The Debian packages that hold each tool, for the message that says what to install.
TOOLS = {
    "containerd": "containerd",
    "ctr": "containerd",
    "runc": "runc",
    "ip": "iproute2",
    "iptables": "iptables",
}


class NodeError(RuntimeError):
    """The node cannot be had or left something behind: the message says what."""


def missing_tools() -> list[str]:
    """What this machine lacks for a node, as ``tool (Debian package)``; empty when nothing."""
    missing = [f"{tool} ({package})" for tool, package in TOOLS.items() if not shutil.which(tool)]
    if cni_bin_dir() is None:
        missing.append("CNI bridge, host-local and loopback plugins (containernetworking-plugins)")
    if not (shutil.which("gcc") or shutil.which("cc")):
        missing.append("a C compiler for the pause image (gcc)")
    return missing


# containerd refuses a socket path longer than this (its ttrpc socket adds ".ttrpc"),
# and a pytest temporary folder can be deeper: the sockets get a short folder of their own.
SOCKET_PATH_MAX = 104


@dataclass(frozen=True, slots=True)
class NodePaths:
    """The node's folders and files, all under ``root`` but for containerd's sockets."""

    root: Path
    socket_dir: Path  # short: /tmp/kvs-<id>

    @property
    def containerd_root(self) -> Path:
        return self.root / "containerd" / "root"

    @property
    def containerd_state(self) -> Path:
        return self.root / "containerd" / "state"

    @property
    def containerd_config(self) -> Path:
        return self.root / "containerd" / "config.toml"

    @property
    def socket(self) -> Path:
        return self.socket_dir / "containerd.sock"

    @property
    def cni_conf_dir(self) -> Path:
        return self.root / "cni" / "net.d"

    @property
    def ipam_dir(self) -> Path:
        return self.root / "cni" / "ipam"

    @property
    def kubelet_root(self) -> Path:
        return self.root / "kubelet"

    @property
    def kubelet_config(self) -> Path:
        return self.root / "kubelet-config.json"

    @property
    def pod_logs(self) -> Path:
        return self.root / "pod-logs"


def containerd_config(paths: NodePaths, cni_bin: Path, runc: Path) -> str:
    """containerd 1.6/1.7's version 2 config (TOML) for this node."""
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    return f"""version = 2
root = "{paths.containerd_root}"
state = "{paths.containerd_state}"

[grpc]
  address = "{paths.socket}"

[ttrpc]
  address = "{paths.socket}.ttrpc"

[plugins."io.containerd.internal.v1.opt"]
  path = "{paths.root / "containerd" / "opt"}"

[{cri}]
  sandbox_image = "{pauseimage.REFERENCE}"
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  enable_selinux = false

[{cri}.containerd]
  snapshotter = "overlayfs"
  default_runtime_name = "runc"

[{cri}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"

[{cri}.containerd.runtimes.runc.options]
  BinaryName = "{runc}"
  SystemdCgroup = false

[{cri}.cni]
  bin_dir = "{cni_bin}"
  conf_dir = "{paths.cni_conf_dir}"
"""


KUBELET_PORT = 10250  # on the node's own address, which no other process on the host has


def kubelet_config(paths: NodePaths, network: PodNetwork, cgroup_root: str) -> dict:
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": network.node_ip,
        "port": KUBELET_PORT,
        "readOnlyPort": 0,
        "healthzPort": 0,  # readiness is read from the Node object instead
        # Only this host reaches the node IP (a private bridge address): the
        # API server's calls (logs, exec) need no client certificate.
        "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
        "authorization": {"mode": "AlwaysAllow"},
        "containerRuntimeEndpoint": f"unix://{paths.socket}",
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": cgroup_root,
        "cgroupsPerQOS": True,
        "enforceNodeAllocatable": ["pods"],
        "failCgroupV1": False,
        "failSwapOn": False,
        "podLogsDir": str(paths.pod_logs),
        "resolvConf": "/etc/resolv.conf",
        "evictionHard": {
            "memory.available": "1Mi",
            "nodefs.available": "1%",
            "nodefs.inodesFree": "1%",
            "imagefs.available": "1%",
        },
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "maxPods": 30,
        "serializeImagePulls": False,
    }


def kubelet_args(binary: Path, paths: NodePaths, kubeconfig: Path, name: str, ip: str) -> list[str]:
    return [
        str(binary),
        f"--config={paths.kubelet_config}",
        f"--kubeconfig={kubeconfig}",
        f"--root-dir={paths.kubelet_root}",
        f"--cert-dir={paths.root / 'kubelet-pki'}",
        f"--hostname-override={name}",
        f"--node-ip={ip}",
        "--v=2",
    ]


class Node:
    """Start with :meth:`start` (blocks until the Node is Ready); :meth:`stop` removes it all.

    ``node_ready(name)`` answers whether the API server has the Node ``name``
    with condition Ready=True: the control plane that owns the credentials asks.
    With ``api_service`` (the ``kubernetes`` Service's ClusterIP and the API
    server's loopback port) the node's pods reach the API server at that
    ClusterIP, as in-cluster clients do (:mod:`kvstrata.testing.apiroute`).
    """

    def __init__(
        self,
        kubelet: Path,
        workdir: Path,
        kubeconfig: Path,
        node_ready: Callable[[str], bool],
        api_service: tuple[str, int] | None = None,
    ) -> None:
        suffix = secrets.token_hex(3)
        self.kubelet = kubelet
        self.paths = NodePaths(workdir, Path(tempfile.gettempdir()) / f"kvs-{suffix}")
        self.kubeconfig = kubeconfig
        self.node_ready = node_ready
        self.name = f"kvstrata-node-{suffix}"
        self.cgroup_root = f"kvstrata-{suffix}"
        # Pods get a route to the kubernetes Service's address alone: through the node.
        routes = () if api_service is None else (f"{api_service[0]}/32",)
        self.network = NodeNetwork(self.paths.cni_conf_dir, self.paths.ipam_dir, routes)
        # Two sets so that the kubelet stops before containerd is asked to.
        self.runtime = ProcessSet(workdir, NodeError)
        self.agent = ProcessSet(workdir, NodeError)
        self.pod_network: PodNetwork | None = None
        self.api_service = api_service
        self.api_route: ApiServiceRoute | None = None

    def start(self, timeout: float = 180) -> PodNetwork:
        missing = missing_tools()
        if missing:
            raise NodeError(f"this machine lacks {', '.join(missing)} for a node")
        self.paths.root.mkdir(parents=True, exist_ok=True)
        try:
            self.paths.socket_dir.mkdir(mode=0o700)
            self.pod_network = self.network.create()
            if self.api_service is not None:
                cluster_ip, api_port = self.api_service
                self.api_route = ApiServiceRoute(self.pod_network.bridge, cluster_ip, api_port)
                self.api_route.add()
            nodeclean.make_cgroup_root(self.cgroup_root)
            self._start_containerd(timeout)
            self.import_image(pauseimage.build(self.paths.root / "pause"))
            self._start_kubelet(timeout)
        except BaseException:
            self.stop()
            raise
        return self.pod_network

    def ctr(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["ctr", "--address", str(self.paths.socket), "--namespace", "k8s.io", *args],
            capture_output=True,
            text=True,
        )

    def import_image(self, archive: Path) -> None:
        """Load an image archive (Docker or OCI) into the node, for pods to run without a pull."""
        done = self.ctr("images", "import", str(archive))
        if done.returncode != 0:
            raise NodeError(f"ctr images import {archive} failed: {done.stderr.strip()}")

    def _start_containerd(self, timeout: float) -> None:
        cni_bin, runc = cni_bin_dir(), shutil.which("runc")
        assert cni_bin is not None and runc is not None  # missing_tools() said so
        self.paths.containerd_config.parent.mkdir(parents=True, exist_ok=True)
        self.paths.containerd_config.write_text(containerd_config(self.paths, cni_bin, Path(runc)))
        process = self.runtime.spawn(
            "containerd", ["containerd", "--config", str(self.paths.containerd_config)]
        )
        self.runtime.wait(
            "containerd", process, lambda: self.ctr("version").returncode == 0, timeout
        )

    def _start_kubelet(self, timeout: float) -> None:
        assert self.pod_network is not None
        config = kubelet_config(self.paths, self.pod_network, f"/{self.cgroup_root}")
        self.paths.kubelet_config.write_text(json.dumps(config, indent=2))
        args = kubelet_args(
            self.kubelet, self.paths, self.kubeconfig, self.name, self.pod_network.node_ip
        )
        process = self.agent.spawn("kubelet", args)
        self.agent.wait("kubelet", process, lambda: self.node_ready(self.name), timeout)

    def log_tail(self, name: str, size: int = 3000) -> str:
        return self.agent.log_tail(name, size)

    def stop(self) -> None:
        """Stop the kubelet, the pods' processes, the shims and containerd; then unmount
        everything under the node's folder and remove its cgroups and network.

        Every step runs even when an earlier one failed; what could not be
        undone is raised at the end as one :class:`NodeError`.
        """
        self.agent.stop()
        nodeclean.kill_cgroup_processes(self.cgroup_root)
        nodeclean.kill_shims(self.paths.socket)
        self.runtime.stop()
        failures = nodeclean.unmount_under(self.paths.root)
        failures += nodeclean.remove_cgroups(self.cgroup_root)
        if self.api_route is not None:
            failures += self.api_route.remove()
        failures += self.network.remove()
        shutil.rmtree(self.paths.socket_dir, ignore_errors=True)  # ours alone: named by our id
        if failures:
            raise NodeError("the node left behind:\n" + "\n".join(failures))
