"""The node harness in the parts that run without a kubelet or an API server: what it
asks of the assets folder and the machine, the pause image it imports, and its teardown
after a kubelet that dies on start (containerd, the bridge and the cgroups are real).

Not marked ``k8s``: none of this needs a cluster. The teardown test needs root
and containerd, runc, the CNI plugins, ip and gcc; it skips naming what is missing.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import tarfile
import tempfile
from pathlib import Path

import pytest

from kvstrata.testing import controlplane as cp
from kvstrata.testing import node as nodemod
from kvstrata.testing import nodeclean, pauseimage

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
