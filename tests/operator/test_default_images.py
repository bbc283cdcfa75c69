"""Which image each injected container and each managed Valkey gets.

The operator's defaults come from its environment (the chart sets
``KVSTRATA_OPERATOR_<NAME>_IMAGE`` / ``_PULL_POLICY``); a KVCache that names an
image wins for its own pods.
"""

from __future__ import annotations

import jsonpatch
import pytest

from kvstrata.operator import resources as R
from kvstrata.operator import spec as S
from kvstrata.operator.mutate import mutate_pod
from kvstrata.operator.sidecar_container import INSTALLER, SIDECAR

CACHE = {S.CACHE_ANNOTATION: "demo"}
IMAGES = S.Images(
    sidecar=S.Image("registry.example/sidecar:1", "Always"),
    sidecar_cuda=S.Image("registry.example/sidecar-cuda:1", "IfNotPresent"),
    installer=S.Image("registry.example/installer:1", "Never"),
    valkey=S.Image("registry.example/valkey:8", "Always"),
)


def injected(pod, kvcache, images=IMAGES):
    result = mutate_pod(pod, kvcache, images=images)
    assert result.injected, result.skipped
    out = jsonpatch.apply_patch(pod, result.patch)
    return {c["name"]: c for c in out["spec"]["initContainers"]}


def gpu_pod(make_pod):
    return make_pod(
        CACHE,
        [
            {
                "name": "vllm",
                "image": "vllm/vllm-openai",
                "resources": {"limits": {"nvidia.com/gpu": 1}},
            }
        ],
    )


def test_a_sidecar_given_a_gpu_runs_the_cuda_image_and_the_installer_its_own(
    make_pod, make_kvcache
):
    init = injected(gpu_pod(make_pod), make_kvcache())
    assert (init[SIDECAR]["image"], init[SIDECAR]["imagePullPolicy"]) == (
        "registry.example/sidecar-cuda:1",
        "IfNotPresent",
    )
    assert (init[INSTALLER]["image"], init[INSTALLER]["imagePullPolicy"]) == (
        "registry.example/installer:1",
        "Never",
    )


@pytest.mark.parametrize(
    ("mode", "gpu"),
    [("host", True), ("auto", False), ("ipc", False)],
    ids=["host", "no-gpu", "ipc-no-gpu"],
)
def test_a_sidecar_without_a_gpu_runs_the_slim_image(make_pod, make_kvcache, mode, gpu):
    pod = gpu_pod(make_pod) if gpu else make_pod(CACHE)
    init = injected(pod, make_kvcache(transferMode=mode))
    assert (init[SIDECAR]["image"], init[SIDECAR]["imagePullPolicy"]) == (
        "registry.example/sidecar:1",
        "Always",
    )


def test_an_image_the_kvcache_names_wins_for_the_sidecar_and_the_installer(make_pod, make_kvcache):
    kvcache = make_kvcache(sidecar={"image": "mine/kvstrata:2", "imagePullPolicy": "Always"})
    init = injected(gpu_pod(make_pod), kvcache)
    for name in (SIDECAR, INSTALLER):
        assert (init[name]["image"], init[name]["imagePullPolicy"]) == ("mine/kvstrata:2", "Always")


def test_the_operator_reads_its_default_images_from_its_environment(
    make_pod, make_kvcache, monkeypatch
):
    monkeypatch.setenv("KVSTRATA_OPERATOR_SIDECAR_IMAGE", "registry.example/sc@sha256:" + "0" * 64)
    monkeypatch.setenv("KVSTRATA_OPERATOR_SIDECAR_PULL_POLICY", "Always")
    monkeypatch.setenv("KVSTRATA_OPERATOR_VALKEY_IMAGE", "registry.example/valkey:8.1.0")
    monkeypatch.setenv("KVSTRATA_OPERATOR_INSTALLER_IMAGE", "")  # empty: the default
    init = injected(make_pod(CACHE), make_kvcache(), images=None)
    assert init[SIDECAR]["image"] == "registry.example/sc@sha256:" + "0" * 64
    assert init[SIDECAR]["imagePullPolicy"] == "Always"
    assert init[INSTALLER]["image"] == S.Images().installer.ref

    kvcache = make_kvcache(shared={"backend": "valkey", "valkey": {"managed": {}}})
    (valkey,) = R.render_valkey_statefulset(kvcache)["spec"]["template"]["spec"]["containers"]
    assert valkey["image"] == "registry.example/valkey:8.1.0"
    managed = make_kvcache(
        shared={"backend": "valkey", "valkey": {"managed": {"image": "own/valkey:8"}}}
    )
    (own,) = R.render_valkey_statefulset(managed)["spec"]["template"]["spec"]["containers"]
    assert own["image"] == "own/valkey:8"


def test_an_unknown_pull_policy_in_the_environment_is_refused_by_name():
    with pytest.raises(ValueError, match="KVSTRATA_OPERATOR_VALKEY_PULL_POLICY"):
        S.Images.from_env({"KVSTRATA_OPERATOR_VALKEY_PULL_POLICY": "Sometimes"})


def test_without_environment_the_defaults_are_this_versions_images():
    from kvstrata import __version__

    images = S.Images.from_env({})
    assert images == S.Images()
    assert images.sidecar.ref == f"ghcr.io/kvstrata/kvstrata-sidecar:{__version__}"
    assert images.sidecar_cuda.ref == f"ghcr.io/kvstrata/kvstrata-sidecar-cuda:{__version__}"
    assert images.installer == images.sidecar  # the slim sidecar image holds the installer
