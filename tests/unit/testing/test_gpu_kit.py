"""``make gpu-kit`` on a machine without a GPU: the kit builds, fits, and says why it stops.

The kit is built for real (pip downloads its wheels), measured against its
size limit, and its driver run with this venv's CPU torch: it must stop at
once with exit 2 and a "no CUDA device" line, before installing anything.
Where a Python 3.12 is at hand (the kit's wheels are cp312), the driver's
``--install-only`` installs the wheels offline into a venv and imports
what the checks import, as the GPU machine will.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvstrata.testing import gpukit, gpukit_build

REPO = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def kit(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("kit") / "gpu-kit"
    gpukit_build.build_kit(REPO, dest)
    return dest


def python312() -> str | None:
    found = shutil.which("python3.12")
    if found and subprocess.run([found, "--version"], capture_output=True).returncode == 0:
        return found
    pyenv = sorted(Path.home().glob(".pyenv/versions/3.12*/bin/python3.12"))
    return str(pyenv[-1]) if pyenv else None


def test_the_kit_holds_the_source_the_driver_and_cp312_wheels_within_60_mib(kit: Path) -> None:
    assert gpukit_build.folder_bytes(kit) <= 60 << 20
    assert os.access(kit / "run.sh", os.X_OK)
    assert (kit / "kvstrata" / "csrc" / "kvs_ipc.cu").is_file()
    assert (kit / "kvstrata" / "src" / "kvstrata" / "sidecar" / "server.py").is_file()
    wheels = {w.name.split("-")[0].lower() for w in (kit / "wheels").glob("*.whl")}
    assert {
        "pyzmq",
        "msgpack",
        "pydantic",
        "pydantic_core",
        "cbor2",
        "redis",
        "boto3",
        "cryptography",
        "pytest",
    } <= wheels
    for wheel in (kit / "wheels").glob("*.whl"):
        tags = wheel.name.removesuffix(".whl").split("-")[-3:]
        # cp312, pure Python, or the stable ABI of an older CPython (cryptography's abi3)
        assert tags[0] in ("py3", "py2.py3", "cp312") or tags[1] == "abi3", wheel.name
        assert tags[2] == "any" or ("manylinux" in tags[2] and "x86_64" in tags[2]), wheel.name
    # No build output travels: the GPU machine compiles csrc for its own GPU.
    assert not list((kit / "kvstrata").rglob("*.so"))


def test_the_kit_driver_stops_at_once_saying_no_cuda_device(kit: Path, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable, "KVSTRATA_KIT_WORK": str(tmp_path / "work")}
    done = subprocess.run(
        [str(kit / "run.sh"), str(tmp_path / "results")],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout.strip().startswith("no CUDA device: torch "), done.stdout
    assert not (tmp_path / "work" / "venv").exists()  # nothing installed before the check


def test_the_kit_installs_its_wheels_offline_over_a_venv_python_and_imports_what_it_needs(
    kit: Path, tmp_path: Path
) -> None:
    # The lent machines' python3 is itself a venv (/opt/torch/.venv) holding torch
    # and numpy: here a venv of Python 3.12 holding numpy plays it. The kit's venv
    # must see its packages (not install numpy again) and import what the checks do.
    interpreter = python312()
    if interpreter is None:
        pytest.skip("no Python 3.12 on this machine to install the cp312 wheels into")
    machine = tmp_path / "machine-venv"
    subprocess.run([interpreter, "-m", "venv", str(machine)], check=True)
    subprocess.run(
        [str(machine / "bin" / "python"), "-m", "pip", "install", "-q", "--no-index",
         "--find-links", str(kit / "wheels"), "numpy"],
        check=True,
    )  # fmt: skip
    work = tmp_path / "work"
    env = {**os.environ, "PYTHON": str(machine / "bin" / "python"),
           "KVSTRATA_KIT_WORK": str(work), "PIP_NO_INDEX": "1", "PYTHONPATH": ""}  # fmt: skip
    done = subprocess.run(
        [str(kit / "run.sh"), "--install-only"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "imports: ok" in done.stdout
    installed = {p.name.lower() for p in (work / "venv").glob("lib/python3.12/site-packages/*")}
    assert "numpy" not in installed  # the machine's own
    assert "zmq" in installed  # the kit's


def test_the_kit_checks_write_their_json_and_exit_2_without_a_gpu(tmp_path: Path) -> None:
    out = tmp_path / "gpu-kit.json"
    assert gpukit.main(["--json", str(out)]) == 2
    record = json.loads(out.read_text())
    assert record["ok"] is False
    assert record["skipped"].startswith("no CUDA device: ")


def test_the_kit_runs_every_check_the_gpu_machine_must_show() -> None:
    assert list(gpukit.checks()) == [
        "kernels", "torch-copier", "connector-stream", "handle-format", "ipc-round-trip",
        "handle-cleanup", "killed-peer-save", "killed-peer-load", "device-context", "bench",
    ]  # fmt: skip


# vLLM shadowed by the kit's stand-in, as run.sh puts it where no vLLM is installed
# (the lent GPU machines): here the stand-in comes first on PYTHONPATH. The checks
# start their workers as spawned processes, which import the connector afresh.
WITHOUT_VLLM = """
import multiprocessing, sys
import vllm
assert getattr(vllm, "STANDIN", False), vllm.__file__
from kvstrata.bench import transfer
from kvstrata.sidecar.transfer import kernels
from kvstrata.testing import gpukit, selftest

def worker_imports(queue):
    import vllm
    from kvstrata.connector.ipc import cuda_memory_handle
    from kvstrata.testing import gpupeers, gpuworker, workers
    queue.put((vllm.__file__, cuda_memory_handle(bytes([3]) + b"c" + bytes(range(64)))))

if __name__ == "__main__":
    selftest.check_kernels(kernels.load_host(), device="cpu")
    selftest.check_torch_copier(device="cpu")
    transfer._case("BLNHC", 8, "cpu")
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=worker_imports, args=(queue,))
    proc.start()
    where, payload = queue.get(timeout=120)
    proc.join(30)
    assert proc.exitcode == 0 and payload == bytes(range(64)), (proc.exitcode, payload)
    print("checked without vLLM; a spawned worker imported", where)
"""


def test_the_kits_checks_and_their_workers_run_on_the_vllm_stand_in(tmp_path: Path) -> None:
    standin = REPO / gpukit_build.VLLM_STANDIN
    script = tmp_path / "without_vllm.py"
    script.write_text(WITHOUT_VLLM)
    path = os.pathsep.join(filter(None, [str(standin), os.environ.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": path},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"imported {standin}" in done.stdout, done.stdout


def test_the_kit_driver_puts_the_stand_in_on_pythonpath_only_where_vllm_is_missing() -> None:
    driver = (REPO / gpukit_build.KIT_FILES / "run.sh").read_text()
    guard = driver.index('if ! "$VENV/bin/python" -c "import vllm"')
    assert driver.index(f"$KIT/kvstrata/{gpukit_build.VLLM_STANDIN}") > guard
    # the stand-in is set before the checks and the gpu suite start
    checks = driver.index('"$VENV/bin/python" -m kvstrata.testing.gpukit')
    assert guard < checks < driver.index('"$VENV/bin/python" -X faulthandler -m pytest -m gpu')
