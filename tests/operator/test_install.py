"""The injected init container's copy of kvstrata is importable on its own."""

from __future__ import annotations

import os
import subprocess
import sys

from kvstrata.operator import install


def test_the_copied_package_is_what_a_fresh_python_imports(tmp_path):
    target = tmp_path / "python"
    done = subprocess.run(
        [sys.executable, "-m", "kvstrata.operator.install", str(target)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert (target / "kvstrata" / "connector" / "client.py").is_file()
    assert (target / "kvstrata" / "sidecar" / "tiers" / "base.py").is_file()
    assert not (target / "kvstrata" / "operator").exists()
    assert not any(p.is_symlink() for p in target.rglob("*"))
    env = {**os.environ, "PYTHONPATH": str(target)}
    code = (
        "import kvstrata.connector.client as c, kvstrata.sidecar.keys as k;"
        "print(c.__file__, k.__file__)"
    )
    shown = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60
    )
    assert shown.returncode == 0, shown.stderr
    assert all(path.startswith(str(target)) for path in shown.stdout.split())


def test_install_without_a_directory_explains_its_usage(capsys):
    assert install.main([]) == 2
    assert "usage" in capsys.readouterr().err
