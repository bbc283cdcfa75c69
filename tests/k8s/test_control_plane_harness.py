"""The loopback control plane harness, in the parts that run without a kube-apiserver binary.

What it writes (certificates, token file, service-account keys, kubeconfig)
is read back by the same loaders the suite and the operator use; etcd is
started for real where an ``etcd`` binary is at hand (``KUBEBUILDER_ASSETS``
or ``PATH``). Not marked ``k8s``: none of this needs a cluster.
"""

from __future__ import annotations

import csv
import shutil
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from kvstrata.testing import controlplane as cp


def stand_in(folder: Path, name: str, script: str = "exit 0") -> Path:
    """An executable file named like a control-plane binary (a stand-in, for detection)."""
    path = folder / name
    path.write_text(f"#!/bin/sh\n{script}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_no_assets_variable_means_no_control_plane_of_our_own():
    assert cp.find_assets({}) is None


def test_an_assets_folder_without_kube_apiserver_is_an_error_naming_it(tmp_path):
    stand_in(tmp_path, "etcd")
    with pytest.raises(cp.ControlPlaneError, match="no executable kube-apiserver"):
        cp.find_assets({cp.ASSETS_ENV: str(tmp_path)})


def test_the_controller_manager_is_optional(tmp_path):
    stand_in(tmp_path, "etcd")
    stand_in(tmp_path, "kube-apiserver")
    assets = cp.find_assets({cp.ASSETS_ENV: str(tmp_path)})
    assert assets is not None and assets.kube_controller_manager is None
    stand_in(tmp_path, "kube-controller-manager")
    assets = cp.find_assets({cp.ASSETS_ENV: str(tmp_path)})
    assert assets.kube_controller_manager == tmp_path / "kube-controller-manager"


def test_the_written_kubeconfig_loads_as_the_operator_loads_it(tmp_path, monkeypatch):
    from kvstrata.operator import kube

    files = cp.Files(tmp_path / "pki")
    files.write("https://127.0.0.1:6443")
    monkeypatch.setenv("KUBECONFIG", str(files.kubeconfig))
    configuration = kube.client_configuration()
    assert configuration.host == "https://127.0.0.1:6443"
    assert Path(configuration.ssl_ca_cert).read_bytes() == files.ca.read_bytes()
    assert configuration.get_api_key_with_prefix("BearerToken") == f"Bearer {files.token}"
    # The API server's token file names the same token, for a system:masters user.
    with files.token_file.open() as rows:
        token, user, _, groups = next(csv.reader(rows))
    assert (token, user, groups) == (files.token, cp.ADMIN_USER, "system:masters")
    # Its serving certificate is for 127.0.0.1 and issued by the CA the kubeconfig trusts.
    cert = x509.load_pem_x509_certificate(files.serving_cert.read_bytes())
    cert.verify_directly_issued_by(x509.load_pem_x509_certificate(files.ca.read_bytes()))
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "127.0.0.1" in [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)]


def test_the_api_server_flags_name_files_that_exist_and_keys_that_match(tmp_path):
    files = cp.Files(tmp_path / "pki")
    files.write("https://127.0.0.1:6443")
    args = cp.apiserver_args(Path("kube-apiserver"), files, "http://127.0.0.1:2379", 6443, True)
    flags = dict(a.removeprefix("--").split("=", 1) for a in args[1:])
    assert len(flags) == len(args) - 1  # no flag given twice
    for name in (
        "tls-cert-file",
        "tls-private-key-file",
        "token-auth-file",
        "service-account-key-file",
        "service-account-signing-key-file",
    ):
        assert Path(flags[name]).is_file(), name
    assert flags["etcd-servers"] == "http://127.0.0.1:2379"
    assert flags["secure-port"] == "6443" and flags["bind-address"] == "127.0.0.1"
    assert "disable-admission-plugins" not in flags
    private = serialization.load_pem_private_key(files.sa_key.read_bytes(), None)
    public = serialization.load_pem_public_key(files.sa_pub.read_bytes())
    assert private.public_key().public_numbers() == public.public_numbers()
    without_kcm = cp.apiserver_args(Path("k"), files, "http://e", 1, False)
    assert "--disable-admission-plugins=ServiceAccount" in without_kcm


def etcd_binary() -> Path:
    assets_etcd = None
    try:
        assets = cp.find_assets()
        assets_etcd = assets.etcd if assets else None
    except cp.ControlPlaneError:
        pass
    found = assets_etcd or shutil.which("etcd")
    if not found:
        pytest.skip("no etcd binary on this machine (KUBEBUILDER_ASSETS or PATH)")
    return Path(found)


def test_etcd_starts_answers_health_and_stops(tmp_path):
    plane = cp.ControlPlane(cp.Assets(etcd_binary(), Path("unused"), None), tmp_path)
    tmp_path.mkdir(exist_ok=True)
    try:
        url = plane.start_etcd()
        assert url.startswith("http://127.0.0.1:")
        ((name, process),) = plane.processes
        assert name == "etcd" and process.poll() is None
    finally:
        plane.stop()
    assert process.poll() is not None and plane.processes == []


def test_an_api_server_that_exits_fails_the_start_with_its_log_and_stops_etcd(tmp_path):
    etcd = etcd_binary()
    # A kube-apiserver stand-in that refuses its flags, as a wrong binary would.
    bogus = stand_in(tmp_path, "kube-apiserver", 'echo "Error: unknown flag: $1" >&2; exit 1')
    plane = cp.ControlPlane(cp.Assets(etcd, bogus, None), tmp_path / "plane")
    with pytest.raises(cp.ControlPlaneError, match="kube-apiserver exited with 1") as failed:
        plane.start()
    assert "unknown flag: --etcd-servers=http://127.0.0.1:" in str(failed.value)
    assert plane.processes == []  # etcd stopped too
