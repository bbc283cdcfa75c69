#!/usr/bin/env bash
# The GPU kit's driver (made by `make gpu-kit`): runs on a machine with a CUDA GPU,
# Python 3.12 and PyTorch >= 2.11 installed and no network.
#
#   ./run.sh [RESULTS_DIR]      default: ./results; writes gpu-kit.json, build.log and pytest.log there
#   ./run.sh --install-only     the venv and the imports only (no GPU needed)
#
# Steps: a CUDA device is seen by torch (else exit 2 at once, "no CUDA device: ..."),
# a venv over the machine's packages with the kit's wheels (no index), csrc built
# with nvcc for this GPU, then one line per check (python -m kvstrata.testing.gpukit),
# then the gpu-marked pytest suite (tests/gpu) on the same build: one line, log in
# RESULTS/pytest.log. Exit 0 when both passed.
set -uo pipefail
KIT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PY="${PYTHON:-python3}"
MODE=run
if [ "${1:-}" = "--install-only" ]; then MODE=install; shift; fi
RESULTS="${1:-$KIT/results}"
WORK="${KVSTRATA_KIT_WORK:-${TMPDIR:-/tmp}/kvstrata-gpu-kit}"
mkdir -p "$RESULTS" "$WORK"

if [ "$MODE" = run ]; then
  # Before anything slow: without a GPU there is nothing to check.
  if ! "$PY" - <<'PY'
import sys
try:
    import torch
except ImportError as exc:
    print(f"cannot run: torch is not importable by {sys.executable} ({exc})")
    sys.exit(2)
if not torch.cuda.is_available():
    built = "built without CUDA" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
    print(f"no CUDA device: torch {torch.__version__} ({built}) sees none")
    sys.exit(2)
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}")
PY
  then
    exit 2
  fi
fi

echo ">> venv over $("$PY" -c 'import sys; print(sys.executable)') with the kit's wheels"
VENV="$WORK/venv"
"$PY" -m venv --system-site-packages "$VENV" || exit 3
# Where python3 is itself a venv (the lent machines': /opt/torch/.venv), the new
# venv's "system" packages are the base interpreter's, not torch's: name the
# interpreter's own site directories in a .pth, after the kit venv's own, so torch
# and what the machine has are seen (and pip does not install them again).
"$VENV/bin/python" - "$PY" <<'PY' || exit 3
import pathlib, subprocess, sys, sysconfig
shown = subprocess.run(
    [sys.argv[1], "-c", "import sys; print(chr(10).join(p for p in sys.path if p.endswith('-packages')))"],
    capture_output=True, text=True, check=True).stdout.split()
mine = pathlib.Path(sysconfig.get_paths()["purelib"])
(mine / "zz-kvstrata-kit-machine.pth").write_text("".join(f"{p}\n" for p in shown if p))
PY
"$VENV/bin/python" -m pip install -q --no-index --find-links "$KIT/wheels" \
  --disable-pip-version-check -r "$KIT/requirements.txt" || exit 3
export PYTHONPATH="$KIT/kvstrata/src${PYTHONPATH:+:$PYTHONPATH}"
export KVSTRATA_CSRC_DIR="$KIT/kvstrata/csrc" KVSTRATA_CACHE_DIR="$WORK/cache"
export PYTHONUNBUFFERED=1 PYTHONHASHSEED=0
# No vLLM on most lent GPU machines: the connector's worker-side modules the checks
# drive subclass one empty vLLM class, which the kit's stand-in (a test double,
# tests/gpu/kit/vllm_standin) provides. On PYTHONPATH, so the checks' worker
# processes see it too; never where a real vLLM imports.
if ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  export PYTHONPATH="$PYTHONPATH:$KIT/kvstrata/tests/gpu/kit/vllm_standin"
  echo ">> vllm is not installed here: the connector imports its base class from the kit's stand-in"
fi
"$VENV/bin/python" -c "
import kvstrata.sidecar.server, kvstrata.sidecar.main, kvstrata.sidecar.tiers.s3
import kvstrata.sidecar.tiers.valkey, kvstrata.sidecar.sealing, kvstrata.testing.gpukit
import kvstrata.bench.transfer
print('imports: ok')" || exit 3
[ "$MODE" = install ] && exit 0

echo ">> building csrc with $(command -v nvcc || echo /usr/local/cuda/bin/nvcc)"
# Only this GPU's architecture: a third of the compile time of the default list.
export KVSTRATA_CUDA_ARCHS="${KVSTRATA_CUDA_ARCHS:-$("$VENV/bin/python" -c '
import torch; major, minor = torch.cuda.get_device_capability(0); print(f"{major}{minor}")')}"
"$VENV/bin/python" - >"$RESULTS/build.log" 2>&1 <<'PY' || { cat "$RESULTS/build.log"; exit 3; }
from kvstrata.sidecar.transfer import csrc_build, kernels
csrc = csrc_build.repo_csrc_dir()
for library in (csrc_build.HOST, csrc_build.CUDA):
    print("built", csrc_build.build(library, csrc))
lib = kernels.load_cuda()
print("loaded" if lib is not None else f"NOT loaded: {kernels.cuda_unavailable_reason()}")
PY
cat "$RESULTS/build.log"
"$VENV/bin/python" -m kvstrata.testing.gpukit --json "$RESULTS/gpu-kit.json"
checks=$?

# The gpu-marked pytest suite on the same build, one process per file (a crash
# costs one file's report, not the others'): one line per file, the log in RESULTS.
cd "$KIT/kvstrata" || exit 3
: >"$RESULTS/pytest.log"
tests=0
# KVSTRATA_KIT_TESTS: other test files (a rerun of the ones that failed).
for file in ${KVSTRATA_KIT_TESTS:-tests/gpu/test_*.py}; do
  "$VENV/bin/python" -X faulthandler -m pytest -m gpu "$file" -v -p no:cacheprovider -rfE \
    --timeout 120 >"$WORK/pytest-file.log" 2>&1
  status=$?
  cat "$WORK/pytest-file.log" >>"$RESULTS/pytest.log"
  [ $status = 0 ] || tests=1
  echo "$([ $status = 0 ] && echo PASS || echo FAIL) pytest $file: $(tail -n 1 "$WORK/pytest-file.log")"
done
[ $checks = 0 ] && [ $tests = 0 ] && exit 0
exit 1
