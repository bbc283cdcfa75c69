"""The node harness in the parts that run without a kubelet or an API server: what it
asks of the assets folder and the machine, the pause image it imports, and its teardown
after a kubelet that dies on start (containerd, the bridge and the cgroups are real).

Not marked ``k8s``: none of this needs a cluster. The teardown test needs root
and containerd, runc, the CNI plugins, ip and gcc; it skips naming what is missing.
"""

from __future__ import annotations

import errno
import hashlib
import io
import ipaddress
import json
import os
import socket
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest

from kvstrata.testing import apiroute, nodeclean, nodenet, pauseimage
from kvstrata.testing import controlplane as cp
from kvstrata.testing import node as nodemod

from .test_control_plane_harness import stand_in


def test_a_folder_without_a_kubelet_gives_no_node_and_says_so(tmp_path):
    for name in ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler"):
        stand_in(tmp_path, name)
    assets = cp.find_assets({cp.ASSETS_ENV: str(tmp_path)})
    assert assets.node_missing == ["kubelet"]
    assert cp.node_unavailable(assets) == f"{cp.ASSETS_ENV} has no kubelet"
    stand_in(tmp_path, "kubelet")
    assets = cp.find_assets({cp.ASSETS_ENV: str(tmp_path)})
    assert assets.kubelet == tmp_path / "kubelet" and assets.node_missing == []


def test_the_api_server_dials_webhooks_at_endpoint_addresses(tmp_path):
    files = cp.Files(tmp_path / "pki")
    files.write("https://127.0.0.1:6443")
    args = cp.apiserver_args(Path("kube-apiserver"), files, "http://127.0.0.1:2379", 6443, True)
    assert "--enable-aggregator-routing=true" in args  # no kube-proxy for ClusterIPs


def test_the_api_server_dials_the_kubelet_at_its_address_not_its_unresolvable_name(tmp_path):
    # Logs and exec go from the API server to the kubelet; by default it dials the
    # Node's hostname first, which no resolver here knows (seen on the node: "lookup
    # kvstrata-node-...: no such host" for every `kubectl logs`).
    files = cp.Files(tmp_path / "pki")
    files.write("https://127.0.0.1:6443")
    args = cp.apiserver_args(Path("kube-apiserver"), files, "http://127.0.0.1:2379", 6443, True)
    assert "--kubelet-preferred-address-types=InternalIP" in args


def test_the_api_servers_certificate_names_the_kubernetes_service_pods_dial(tmp_path):
    from cryptography import x509

    files = cp.Files(tmp_path / "pki")
    files.write("https://127.0.0.1:6443")
    cert = x509.load_pem_x509_certificate(files.serving_cert.read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    addresses = {str(a) for a in names.get_values_for_type(x509.IPAddress)}
    assert {"127.0.0.1", cp.API_SERVICE_IP} <= addresses
    assert cp.API_SERVICE_IP == "10.0.0.1"  # the first address of the service range
    assert "kubernetes.default.svc" in names.get_values_for_type(x509.DNSName)


def test_pods_are_routed_to_the_kubernetes_service_through_the_node_and_nowhere_else(tmp_path):
    # Seen on the node: the operator's pod had no route to 10.0.0.1 ("Network is
    # unreachable"): the bridge plugin gives pods a gateway but no route to use it.
    network = nodenet.PodNetwork("kvstest", ipaddress.ip_network("10.213.7.0/24"))
    conf = network.cni_config(tmp_path, routes=(f"{cp.API_SERVICE_IP}/32",))
    (bridge,) = conf["plugins"]
    assert bridge["ipam"]["routes"] == [{"dst": "10.0.0.1/32"}]
    assert bridge["ipam"]["ranges"] == [[{"subnet": "10.213.7.0/24", "gateway": "10.213.7.1"}]]
    assert not bridge.get("isDefaultGateway") and not bridge["ipMasq"]


def test_a_client_in_a_pod_network_namespace_reaches_the_api_server_at_the_cluster_ip(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("a bridge, a network namespace and an iptables rule need root")
    if nodemod.missing_tools():
        pytest.skip(f"this machine lacks {', '.join(nodemod.missing_tools())}")
    routes = (f"{cp.API_SERVICE_IP}/32",)
    network = nodenet.NodeNetwork(tmp_path / "net.d", tmp_path / "ipam", routes)
    server = socket.create_server(("127.0.0.1", 0))  # stands for the API server
    port = server.getsockname()[1]
    pod = network.create()
    route = apiroute.ApiServiceRoute(pod.bridge, cp.API_SERVICE_IP, port)
    netns, host_end = f"kvstest{os.getpid()}", f"kvh{os.getpid()}"
    try:
        # What the bridge plugin makes for a pod: a namespace, a veth pair on the
        # bridge, an address of the subnet and the routes the CNI config names.
        for args in (
            ["netns", "add", netns],
            ["link", "add", host_end, "type", "veth", "peer", "name", "eth0", "netns", netns],
            ["link", "set", host_end, "master", pod.bridge, "up"],
            ["-n", netns, "addr", "add", f"{pod.subnet.network_address + 9}/24", "dev", "eth0"],
            ["-n", netns, "link", "set", "eth0", "up"],
            ["-n", netns, "route", "add", routes[0], "via", pod.node_ip],
        ):
            nodenet.run_ip(*args)
        route.add()
        client = subprocess.Popen(
            ["ip", "netns", "exec", netns, sys.executable, "-c", CLIENT, cp.API_SERVICE_IP],
            stdout=subprocess.PIPE,
            text=True,
        )
        server.settimeout(30)
        accepted, peer = server.accept()
        with accepted:
            accepted.sendall(b"api server")
        assert client.communicate(timeout=30)[0] == "api server"
        assert peer[0] == str(pod.subnet.network_address + 9)  # the pod's own address
    finally:
        server.close()
        assert route.remove() == []
        subprocess.run(["ip", "netns", "delete", netns], check=False)
        assert network.remove() == []
    rules = subprocess.run(["iptables", "-t", "nat", "-S", "PREROUTING"], capture_output=True)
    assert pod.bridge.encode() not in rules.stdout  # the rule went with the node


CLIENT = """
import socket, sys
with socket.create_connection((sys.argv[1], 443), timeout=20) as s:
    print(s.recv(64).decode(), end="")
"""


def test_the_pause_image_archive_names_its_one_layer_by_digest(tmp_path):
    binary = tmp_path / "pause"
    binary.write_bytes(b"\x7fELF stand-in")
    archive = pauseimage.write_archive(binary, tmp_path / "image.tar", "localhost/x/pause:t")
    with tarfile.open(archive) as tar:
        (entry,) = json.load(tar.extractfile("manifest.json"))
        config = json.load(tar.extractfile(entry["Config"]))
        layer = tar.extractfile(entry["Layers"][0]).read()
    assert entry["RepoTags"] == ["localhost/x/pause:t"]
    assert config["config"]["Entrypoint"] == ["/pause"]
    assert config["rootfs"]["diff_ids"] == [f"sha256:{hashlib.sha256(layer).hexdigest()}"]
    with tarfile.open(fileobj=io.BytesIO(layer)) as inner:
        member = inner.getmember("pause")
        assert member.mode == 0o755 and inner.extractfile(member).read() == b"\x7fELF stand-in"


def test_mounts_under_a_folder_are_listed_deepest_first(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    outer, inner = tmp_path / "a", tmp_path / "a" / "b c"
    outer.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "none", str(outer)], check=True)
    try:
        inner.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "none", str(inner)], check=True)
        assert nodeclean.mounts_under(tmp_path) == [inner, outer]  # a space, escaped in mountinfo
    finally:
        assert nodeclean.unmount_under(tmp_path) == []
    assert nodeclean.mounts_under(tmp_path) == []


def test_a_kubelet_that_dies_on_start_leaves_no_bridge_cgroup_mount_or_containerd(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("a node needs root")
    if nodemod.missing_tools():
        pytest.skip(f"this machine lacks {', '.join(nodemod.missing_tools())}")
    kubelet = stand_in(tmp_path, "kubelet", 'echo "E: failed to run Kubelet: $1" >&2; exit 1')
    node = nodemod.Node(kubelet, tmp_path / "node", tmp_path / "kubeconfig", lambda _: False)
    with pytest.raises(nodemod.NodeError, match="kubelet exited with 1") as failed:
        node.start(timeout=60)
    assert "failed to run Kubelet: --config=" in str(failed.value)
    # It got as far as the network, the cgroups and containerd before the kubelet died.
    assert (tmp_path / "node" / "containerd.log").exists()
    bridge = node.pod_network.bridge
    shown = subprocess.run(["ip", "link", "show", bridge], capture_output=True, text=True)
    assert shown.returncode != 0 and "does not exist" in shown.stderr
    assert not any((h / node.cgroup_root).exists() for h in nodeclean.cgroup_hierarchies())
    assert nodeclean.mounts_under(tmp_path) == []
    assert node.runtime.processes == [] and node.agent.processes == []


def test_a_mount_gone_between_listing_and_unmounting_is_not_a_failure(tmp_path, monkeypatch):
    # The fault (a shim unmounting its rootfs while the teardown runs) is a race the
    # test cannot cause on cue: a stale listing stands in for it, named as such.
    stale = tmp_path / "rootfs"
    real = nodeclean.mounts_under
    listings = iter([[stale]])
    monkeypatch.setattr(
        nodeclean, "mounts_under", lambda folder: next(listings, None) or real(folder)
    )
    assert nodeclean.unmount_under(tmp_path) == []
    # A point still listed after umount -l fails is reported.
    listings = iter([[stale], [stale]])
    (failure,) = nodeclean.unmount_under(tmp_path)
    assert failure.startswith(f"umount {stale}: umount: ")  # umount's own message follows


def test_a_node_that_fails_fails_the_control_plane_start_and_stops_it_all(tmp_path):
    if os.geteuid() != 0 or nodemod.missing_tools():
        pytest.skip(f"a node needs root and {', '.join(nodemod.missing_tools()) or 'root'}")
    try:
        found = cp.find_assets()
    except cp.ControlPlaneError:
        found = None
    if found is None or found.kube_controller_manager is None or found.kube_scheduler is None:
        pytest.skip(f"{cp.ASSETS_ENV} names no folder with a whole control plane")
    # The real control plane; a kubelet stand-in that refuses its flags, as a wrong binary would.
    kubelet = stand_in(tmp_path, "kubelet", 'echo "E: unknown flag: $1" >&2; exit 1')
    assets = cp.Assets(
        found.etcd,
        found.kube_apiserver,
        found.kube_controller_manager,
        found.kube_scheduler,
        kubelet,
    )
    plane = cp.ControlPlane(assets, tmp_path / "plane")
    before = node_traces()
    with pytest.raises(cp.ControlPlaneError, match="the node did not start: kubelet exited with 1"):
        plane.start()
    assert plane.processes == [] and plane.node is None
    assert nodeclean.mounts_under(tmp_path) == []
    assert node_traces() == before  # no bridge, cgroup or socket folder of its own left


def node_traces() -> set[str]:
    """The bridges, cgroup roots and socket folders a node names after itself."""
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    found = {f"link {line.split(':')[1].strip()}" for line in links.splitlines()}
    for hierarchy in nodeclean.cgroup_hierarchies():
        found |= {f"cgroup {p}" for p in hierarchy.glob("kvstrata-*")}
    found |= {f"sockets {p}" for p in Path(tempfile.gettempdir()).glob("kvs-*")}
    return {t for t in found if "kvs" in t}


def test_containerd_sockets_stay_within_the_unix_path_limit_under_a_deep_folder(tmp_path):
    # containerd refuses a socket path over 104 bytes ("unix socket path too long"), and
    # its ttrpc socket is the grpc one plus ".ttrpc"; pytest's folders can be deeper.
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    node = nodemod.Node(Path("kubelet"), deep, tmp_path / "kubeconfig", lambda _: False)
    ttrpc = f"{node.paths.socket}.ttrpc"
    assert len(ttrpc.encode()) <= 104
    config = nodemod.containerd_config(node.paths, Path("/usr/lib/cni"), Path("/usr/sbin/runc"))
    assert f'address = "{ttrpc}"' in config
    assert node.paths.containerd_state.is_relative_to(deep)  # all else stays in the folder


def test_a_cgroup_still_busy_with_exiting_threads_is_removed_once_they_are_gone(
    tmp_path, monkeypatch
):
    # Seen on the node: the teardown killed vLLM's container; the process's leader was
    # a zombie already, its other threads were still exiting, and every rmdir of its
    # cgroups failed with EBUSY. That moment cannot be had on cue: a fault double
    # answers the first rmdir of each cgroup with EBUSY, as the kernel did.
    if os.geteuid() != 0 or not nodeclean.cgroup_hierarchies():
        pytest.skip("making cgroups needs root and cgroup hierarchies")
    name = f"kvstest-busy-{os.getpid()}"
    nodeclean.make_cgroup_root(name)
    (nodeclean.cgroup_hierarchies()[0] / name / "pod").mkdir()
    refused: set[Path] = set()

    def busy_once(folder: Path) -> None:  # fault double: threads still exiting
        if folder not in refused:
            refused.add(folder)
            raise OSError(errno.EBUSY, "Device or resource busy", str(folder))
        os.rmdir(folder)

    monkeypatch.setattr(Path, "rmdir", busy_once)
    try:
        assert nodeclean.remove_cgroups(name) == []
    finally:
        monkeypatch.undo()
        for folder in nodeclean._cgroup_folders(name):  # what a failed removal left
            folder.rmdir()
    assert not any((h / name).exists() for h in nodeclean.cgroup_hierarchies())
