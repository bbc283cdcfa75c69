"""The ``kubernetes`` Service's address, reachable from the pods of the suite's node.

Why this module exists: a pod that talks to the API server (the operator's
own pod, through kopf and the Kubernetes client's in-cluster config) dials
``KUBERNETES_SERVICE_HOST:KUBERNETES_SERVICE_PORT``, which the kubelet sets
to the ``kubernetes`` Service's ClusterIP and port (the first address of
``--service-cluster-ip-range``, port 443). In a real cluster kube-proxy turns
that address into the API server's endpoint; here no kube-proxy runs, and the
API server listens on 127.0.0.1 only (the machine is shared: nothing of the
suite listens on an address other hosts reach).

What was chosen, and why: one ``iptables`` DNAT rule in the ``nat`` table's
PREROUTING chain, for packets that come in on the node's own bridge to the
ClusterIP's port 443, to the API server's 127.0.0.1 port: the one rule
kube-proxy would write for this Service, and nothing else. The kernel routes
a packet rewritten to 127.0.0.1 only when the interface it came in on has
``route_localnet`` set, so that is set on the node's bridge (it exists for
the node alone). The alternatives were worse: binding the API server to the
bridge address would move every client of the suite off loopback (the
out-of-cluster operator's webhook is registered at 127.0.0.1), and setting
``KUBERNETES_SERVICE_HOST`` in the operator's pod would test a pod the chart
does not render. The API server's serving certificate names the ClusterIP
and the Service's DNS names (:mod:`kvstrata.testing.controlplane`), so the
pod's client verifies it with the cluster's root CA as in any cluster.

:meth:`ApiServiceRoute.remove` deletes exactly the rule :meth:`add` made;
``route_localnet`` goes with the bridge.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

SERVICE_PORT = 443  # the kubernetes Service's port in every cluster


class ApiRouteError(RuntimeError):
    """The route cannot be made or removed: the message names the command and its error."""


@dataclass(frozen=True, slots=True)
class ApiServiceRoute:
    """Packets from ``bridge`` to ``cluster_ip``:443 go to 127.0.0.1:``api_port``."""

    bridge: str
    cluster_ip: str
    api_port: int

    def rule(self) -> list[str]:
        """The rule's specification, as ``iptables -t nat -A/-D PREROUTING`` takes it."""
        return [
            "-i",
            self.bridge,
            "-d",
            f"{self.cluster_ip}/32",
            "-p",
            "tcp",
            "--dport",
            str(SERVICE_PORT),
            "-m",
            "comment",
            "--comment",
            f"kvstrata test node {self.bridge}: kubernetes Service",
            "-j",
            "DNAT",
            "--to-destination",
            f"127.0.0.1:{self.api_port}",
        ]

    def add(self) -> None:
        Path(f"/proc/sys/net/ipv4/conf/{self.bridge}/route_localnet").write_text("1\n")
        _iptables("-A", *self.rule())

    def remove(self) -> list[str]:
        """Delete the rule; return what failed (nothing when it was never added)."""
        done = subprocess.run(
            ["iptables", "-t", "nat", "-C", "PREROUTING", *self.rule()], capture_output=True
        )
        if done.returncode != 0:
            return []  # not there: add() never ran or failed before it
        try:
            _iptables("-D", *self.rule())
        except ApiRouteError as exc:
            return [str(exc)]
        return []


def _iptables(action: str, *rule: str) -> None:
    args = ["iptables", "-t", "nat", action, "PREROUTING", *rule]
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode != 0:
        raise ApiRouteError(f"{' '.join(args)} failed: {done.stderr.strip()}")
