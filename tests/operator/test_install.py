"""The injected init container's copy of kvstrata is importable on its own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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


def test_the_copied_msgpack_works_compiled_or_pure_python(tmp_path):
    install.install(tmp_path)
    code = (
        "import msgpack; assert msgpack.unpackb(msgpack.packb([1, b'x'])) == [1, b'x'];"
        "print(msgpack.__file__, msgpack.Packer.__module__)"
    )
    for pure, implementation in (("", "msgpack._cmsgpack"), ("1", "msgpack.fallback")):
        env = {**os.environ, "PYTHONPATH": str(tmp_path), "MSGPACK_PUREPYTHON": pure}
        shown = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60
        )
        assert shown.returncode == 0, shown.stderr
        path, module = shown.stdout.split()
        assert path.startswith(str(tmp_path)) and module == implementation


def test_install_without_a_directory_explains_its_usage(capsys):
    assert install.main([]) == 2
    assert "usage" in capsys.readouterr().err


def test_every_subpackage_of_the_sidecar_and_the_connector_is_copied(tmp_path):
    install.install(tmp_path)
    repo = Path(__file__).resolve().parents[2]
    for tree in ("sidecar", "connector"):
        for init in (repo / tree).rglob("__init__.py"):
            package = init.parent.relative_to(repo)
            for module in init.parent.glob("*.py"):
                copied = tmp_path / "kvstrata" / package / module.name
                assert copied.is_file(), f"{package}/{module.name} not copied"
