"""The pod network of the suite's one node: a Linux bridge of its own on a private /24.

Why this module exists: the kubelet refuses a loopback node IP, pods need
addresses the API server can dial (the webhook is called at its pod's IP,
``--enable-aggregator-routing``), and the machine is shared, so nothing may
take a fixed name or range. What it makes, all named after one short id:

- a bridge ``kvs<id>`` holding the /24's first address: the node's IP (the
  kubelet's ``--node-ip``) and the pods' gateway, so this host reaches pod
  IPs directly with no routing or NAT;
- a CNI config (``bridge`` plugin in the pods' own network namespaces on
  that bridge, ``host-local`` IPAM with its lease files in the node's folder,
  no IP masquerade: the pods need to reach this host only; no default route,
  only the routes the node asks for, the ``kubernetes`` Service's address
  among them, :mod:`kvstrata.testing.apiroute`). containerd adds
  the loopback interface itself with the ``loopback`` plugin from the same
  plugin folder.

Teardown removes the bridge; the pods' veth pairs go with their network
namespaces, which containerd keeps under its own state folder
(``netns_mounts_under_state_dir``) where the node's teardown unmounts them.
"""

from __future__ import annotations

import ipaddress
import json
import secrets
import subprocess
from dataclasses import dataclass
from pathlib import Path

CNI_BIN_DIRS = (Path("/usr/lib/cni"), Path("/opt/cni/bin"))  # Debian's, then upstream's
# Candidate /24s: 10.213.0.0/16 is rarely routed anywhere; the first free one is taken.
CANDIDATES = ipaddress.ip_network("10.213.0.0/16")


class NodeNetworkError(RuntimeError):
    """The pod network cannot be made: the message names the command and its error."""


def run_ip(*args: str) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise NodeNetworkError(f"ip {' '.join(args)} failed: {done.stderr.strip()}")
    return done.stdout


def cni_bin_dir() -> Path | None:
    """The folder with the bridge, host-local and loopback plugins, if this machine has one."""
    for folder in CNI_BIN_DIRS:
        if all((folder / plugin).is_file() for plugin in ("bridge", "host-local", "loopback")):
            return folder
    return None


def networks_in_use() -> list[ipaddress.IPv4Network]:
    """The IPv4 networks of this machine's addresses and routes."""
    used = []
    for line in run_ip("-4", "-o", "addr", "show").splitlines():
        fields = line.split()
        if "inet" in fields:
            used.append(ipaddress.ip_interface(fields[fields.index("inet") + 1]).network)
    for line in run_ip("-4", "route", "show").splitlines():
        first = line.split()[0]
        if first != "default":
            used.append(ipaddress.ip_network(first, strict=False))
    return used


def free_subnet(used: list[ipaddress.IPv4Network]) -> ipaddress.IPv4Network:
    for subnet in CANDIDATES.subnets(new_prefix=24):
        if not any(subnet.overlaps(other) for other in used):
            return subnet
    raise NodeNetworkError(f"every /24 of {CANDIDATES} is in use on this machine")


@dataclass(frozen=True, slots=True)
class PodNetwork:
    bridge: str
    subnet: ipaddress.IPv4Network

    @property
    def node_ip(self) -> str:
        return str(self.subnet.network_address + 1)

    def cni_config(self, ipam_dir: Path, routes: tuple[str, ...] = ()) -> dict:
        """The conflist containerd reads: one bridge network on this subnet; ``routes``
        (CIDRs) are routed through the node's address (the only gateway pods get)."""
        return {
            "cniVersion": "0.4.0",
            "name": self.bridge,
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": self.bridge,
                    "isGateway": True,
                    "ipMasq": False,
                    "hairpinMode": True,
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{"subnet": str(self.subnet), "gateway": self.node_ip}]],
                        "routes": [{"dst": cidr} for cidr in routes],
                        "dataDir": str(ipam_dir),
                    },
                }
            ],
        }


class NodeNetwork:
    """Make with :meth:`create`, remove with :meth:`remove` (also after a failed create)."""

    def __init__(self, conf_dir: Path, ipam_dir: Path, routes: tuple[str, ...] = ()) -> None:
        self.conf_dir = conf_dir
        self.ipam_dir = ipam_dir
        self.routes = routes
        self.network: PodNetwork | None = None

    def create(self) -> PodNetwork:
        network = PodNetwork(f"kvs{secrets.token_hex(3)}", free_subnet(networks_in_use()))
        run_ip("link", "add", "name", network.bridge, "type", "bridge")
        self.network = network  # from here on remove() has something to remove
        run_ip(
            "addr", "add", f"{network.node_ip}/{network.subnet.prefixlen}", "dev", network.bridge
        )
        run_ip("link", "set", network.bridge, "up")
        self.conf_dir.mkdir(parents=True, exist_ok=True)
        self.ipam_dir.mkdir(parents=True, exist_ok=True)
        conflist = self.conf_dir / "10-kvstrata.conflist"
        conflist.write_text(json.dumps(network.cni_config(self.ipam_dir, self.routes), indent=2))
        return network

    def remove(self) -> list[str]:
        """Delete the bridge :meth:`create` made; return what failed."""
        failures = []
        if self.network is not None:
            try:
                run_ip("link", "delete", self.network.bridge)
            except NodeNetworkError as exc:
                failures.append(str(exc))
            self.network = None
        return failures
