"""A tenant's chunks stay the tenant's across a sidecar restart: with
encryption on, each L2 file's sealed header names the tenant whose key
sealed it, so the re-indexed L2 and the chunks promoted from it into L1
are counted (and budgeted) as that tenant's, not the default tenant's."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from kvstrata.testing.keyfolder import MountedSecret, key_files

CHUNK = 64 << 10
TEAM_A = {"name": "team-a", "match": {"cache_salts": ["a"]}, "budgets": {"l2_bytes": "4Mi"}}


def metric(sidecar: Any, name: str, labels: str) -> float:
    found = re.search(rf"^{name}{re.escape(labels)} (\S+)$", sidecar.get("/metrics"), re.M)
    return float(found.group(1)) if found else 0.0


def test_a_restarted_sidecar_reads_the_tenant_back_from_l2_and_keeps_it_when_promoting(
    sidecar_factory: Any, kit: Any, tmp_path: Path
) -> None:
    MountedSecret(tmp_path / "keys").publish(key_files({"k1": os.urandom(32)}, writing="k1"))
    encryption = {"mode": "required", "key_dir": str(tmp_path / "keys")}
    sidecar = sidecar_factory(overrides={"encryption": encryption, "tenants": [TEAM_A]}).start()
    l2_dir = sidecar.root / "l2"
    keys = kit.make_keys(4, seed=820)
    client = sidecar.client()
    assert kit.store(client, keys, CHUNK, owner="w", tenant="team-a") == 4
    kit.wait_until(lambda: len(list(l2_dir.glob("*/*.kvs"))) == 4, 30, "the L2 files")
    held = metric(sidecar, "kvstrata_tenant_bytes", '{tenant="team-a",tier="l2"}')
    assert held > 4 * CHUNK
    client.close()

    sidecar.restart()
    # Re-indexed from the sealed headers: team-a's files, not the default tenant's.
    assert metric(sidecar, "kvstrata_tenant_bytes", '{tenant="team-a",tier="l2"}') == held
    assert metric(sidecar, "kvstrata_tenant_bytes", '{tenant="default",tier="l2"}') == 0
    client = sidecar.client()
    assert kit.retrieve(client, keys, owner="r") == [kit.payload(k, CHUNK) for k in keys]
    # Promoted into the fresh L1 as team-a's chunks.
    assert metric(sidecar, "kvstrata_tenant_bytes", '{tenant="team-a",tier="l1"}') == 4 * CHUNK
    assert metric(sidecar, "kvstrata_tenant_bytes", '{tenant="default",tier="l1"}') == 0
    client.close()
