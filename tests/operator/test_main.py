"""``kvstrata operator`` from the command line."""

from __future__ import annotations

import os
import subprocess
import sys


def test_the_operator_without_any_cluster_config_exits_with_a_clear_message(tmp_path):
    env = {
        **os.environ,
        "HOME": str(tmp_path),
        "KUBECONFIG": str(tmp_path / "absent"),
        "KUBERNETES_SERVICE_HOST": "",
    }
    done = subprocess.run(
        [sys.executable, "-m", "kvstrata.cli", "operator", "--webhook-port", "0"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert done.returncode == 2
    assert "no Kubernetes configuration (in-cluster or KUBECONFIG)" in done.stderr


def test_the_operator_command_does_not_import_kopf_for_help():
    code = "import sys, kvstrata.operator.main; print('kopf' in sys.modules)"
    shown = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert shown.stdout.strip() == "False"
