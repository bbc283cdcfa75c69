"""The sidecar's HTTP endpoints, its config loading and its process life cycle."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvstrata.sidecar.metrics import METRICS

NBYTES = 4096


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def _value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_expose_every_dashboard_name_with_values_that_move(sidecar: Any, kit: Any):
    before = _samples(sidecar.get("/metrics"))
    client = sidecar.client()
    keys = kit.make_keys(4, seed=20)
    kit.store(client, keys, NBYTES, owner="w")
    assert client.lookup(keys, prefetch=False, owner="r").hit_chunks == 4
    assert kit.retrieve(client, keys, owner="r")[0] == kit.payload(keys[0], NBYTES)
    text = sidecar.get("/metrics")
    after = _samples(text)

    names = {name for name, _ in after}
    for name, kind, _, _ in METRICS:
        exposed = f"{name}_count" if kind == "histogram" else name
        assert exposed in names, f"{name} missing from /metrics"

    chunk_tokens = 16  # chunk_size of the test config
    assert _value(after, "kvstrata_lookups_total") == _value(before, "kvstrata_lookups_total") + 1
    assert _value(after, "kvstrata_lookup_tokens_total") >= 4 * chunk_tokens
    assert _value(after, "kvstrata_hit_tokens_total", tier="l1") == 4 * chunk_tokens
    assert _value(after, "kvstrata_tier_objects", tier="l1") >= 4
    assert _value(after, "kvstrata_tier_usage_bytes", tier="l1") >= 4 * NBYTES
    assert _value(after, "kvstrata_tier_capacity_bytes", tier="l1") == 16 << 20
    assert _value(after, "kvstrata_clients") == 1
    count = "kvstrata_operation_duration_seconds_count"
    for op in ("HELLO", "PREPARE_STORE", "COMMIT_STORE", "LOOKUP", "PREPARE_RETRIEVE"):
        assert _value(after, count, op=op) >= 1, op
    client.close()


def test_errors_are_counted_by_kind(sidecar: Any, kit: Any):
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(sidecar.endpoint)
    sock.send(b"not msgpack")
    assert sock.poll(3000)
    sock.recv()
    sock.close(0)
    ctx.term()
    samples = _samples(sidecar.get("/metrics"))
    assert _value(samples, "kvstrata_errors_total", kind="bad_frame") == 1


def test_status_reports_version_arena_tiers_and_clients(sidecar: Any, kit: Any):
    client = sidecar.client(client_id="status-client")
    assert client.ping()
    status = sidecar.status()
    assert status["ready"] is True
    assert status["version"]
    assert status["endpoint"] == sidecar.endpoint
    assert status["chunk_size"] == 16
    assert status["arena"]["size_bytes"] == 16 << 20
    assert os.path.exists(f"/dev/shm/{status['arena']['name']}")
    assert {"l1", "l2"} <= set(status["tiers"])
    assert status["tiers"]["l1"]["capacity_bytes"] == 16 << 20
    assert [c["client_id"] for c in status["clients"]] == ["status-client"]
    assert sidecar.get("/healthz").strip() == "ok"
    assert sidecar.get("/readyz").strip() == "ready"
    client.close()


def test_sigterm_exits_cleanly_and_removes_the_arena_and_socket(sidecar_factory: Any):
    sidecar = sidecar_factory().start()
    arena = sidecar.status()["arena"]["name"]
    socket_path = Path(sidecar.endpoint[len("ipc://") :])
    assert socket_path.exists()
    assert sidecar.stop() == 0
    assert not os.path.exists(f"/dev/shm/{arena}")
    assert not socket_path.exists()


def _run_sidecar(
    kit: Any, args: list[str], env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("KVSTRATA_")}
    return subprocess.run(
        [*kit.SIDECAR_COMMAND, *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**inherited, **(env or {})},
    )


@pytest.mark.parametrize(
    ("config", "args", "field"),
    [
        ({"l1": {"size_bytes": "lots"}}, [], "l1.size_bytes"),
        ({"server": {"http_prot": 1}}, [], "server.http_prot"),
        ({"transfer_mode": "carrier-pigeon"}, [], "transfer_mode"),
        ({"chunk_size": 0}, [], "chunk_size"),
        ({}, ["--http-port", "70000"], "server.http_port"),
        ({}, ["--l1-size", "12XB"], "l1.size_bytes"),
    ],
)
def test_bad_config_is_refused_at_start_naming_the_field(
    tmp_path: Path, kit: Any, config: dict, args: list[str], field: str
):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(config))
    result = _run_sidecar(kit, ["--config", str(path), *args])
    assert result.returncode == 2, result.stderr
    assert field in result.stderr


def test_bad_environment_override_is_refused_naming_the_field(kit: Any):
    result = _run_sidecar(kit, [], env={"KVSTRATA_SERVER__LEASE_SECONDS": "-1"})
    assert result.returncode == 2, result.stderr
    assert "server.lease_seconds" in result.stderr


def test_without_flags_it_serves_on_the_default_endpoint(tmp_path: Path, kit: Any):
    port = kit.free_port()
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("KVSTRATA_")}
    env = {
        **inherited,
        "TMPDIR": str(tmp_path),  # the default endpoint lives under $TMPDIR
        "XDG_CACHE_HOME": str(tmp_path / "cache"),  # the default L2 directory
        # Environment, not flags: keep the test off the shared default port and small.
        "KVSTRATA_SERVER__HTTP_PORT": str(port),
        "KVSTRATA_SERVER__HTTP_HOST": "127.0.0.1",
        "KVSTRATA_L1__SIZE_BYTES": "8Mi",
    }
    log = (tmp_path / "log").open("wb")
    proc = subprocess.Popen(kit.SIDECAR_COMMAND, stdout=log, stderr=subprocess.STDOUT, env=env)
    log.close()
    sidecar = kit.Sidecar.__new__(kit.Sidecar)
    sidecar.http_port, sidecar.proc, sidecar.log_path = port, proc, tmp_path / "log"
    sidecar.endpoint = f"ipc://{tmp_path}/kvstrata/sidecar.sock"
    sidecar.arena_names = set()
    try:
        kit.wait_until(sidecar._ready, kit.START_TIMEOUT_S, "default sidecar ready")
        sidecar.arena_names.add(sidecar.status()["arena"]["name"])
        assert sidecar.status()["endpoint"] == sidecar.endpoint
        assert sidecar.status()["chunk_size"] == 256
        client = sidecar.client()
        assert client.ping(), client.errors
        assert client.chunk_size == 256
        client.close()
        assert sidecar.stop() == 0
    finally:
        sidecar.cleanup()


def _threads_cpus(pid: int) -> dict[str, str]:
    """Each thread's ``Cpus_allowed_list`` (proc(5)) by thread id."""
    out = {}
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/status") as status:
            for line in status:
                if line.startswith("Cpus_allowed_list:"):
                    out[task] = line.split(":", 1)[1].strip()
    return out


def test_cpus_pins_every_thread_of_the_serving_sidecar(sidecar_factory: Any, kit: Any):
    cpu = max(os.sched_getaffinity(0))  # one this test process may use: so may its child
    sidecar = sidecar_factory(overrides={"cpus": str(cpu)}).start()
    client = sidecar.client()  # serving: the threads a session starts exist too
    keys = kit.make_keys(2, seed=31)
    kit.store(client, keys, NBYTES, owner="w")
    threads = _threads_cpus(sidecar.proc.pid)
    assert len(threads) > 1
    assert set(threads.values()) == {str(cpu)}, threads


def test_cpus_outside_the_allowed_set_are_refused_at_start_naming_them(kit: Any):
    beyond = max(os.sched_getaffinity(0)) + 1000
    result = _run_sidecar(kit, [], env={"KVSTRATA_CPUS": str(beyond)})
    assert result.returncode == 2, result.stderr
    assert f"CPU(s) {beyond} are not among" in result.stderr
