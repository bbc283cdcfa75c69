"""``kvstrata bench soak``: every fault at once under ``vllm serve``, replayable by seed.

What runs, each in its own process: ``vllm serve`` with multiprocessing on
(bench/serve.py's launcher, with the kvstrata connector and vLLM's KV event
publisher), a ``kvstrata sidecar`` restarted by :mod:`.supervisor` as the
kubelet would, a real redis-server (Valkey protocol) and moto's S3 server,
each shared tier behind a fault proxy (:mod:`.faultproxy`). The sidecar and
vLLM share a private mount namespace made by the run, with its own small
``/dev/shm`` and a small tmpfs for L2, so "``/dev/shm`` nearly full" and "L2
disk full" are real filesystems filling up, and no other process's
segments are counted.

The load: a few users with prompts sharing prefixes of several lengths
(token ids), greedy, ``concurrency`` at once, through vLLM's OpenAI API
(streamed: TTFT is the first token's arrival). Every prompt's output was
computed beforehand by the same model in ``vllm serve`` without the
connector (the same launcher, no ``--kv-transfer-config``); every output of
the soak must equal it token for token.

The availability rule (also in the JSON): a request that fails while the
schedule has killed vLLM itself (from the kill until the new server
answers) is retried, since that is vLLM's availability and not the cache's;
every other failed or non-200 request counts as failed.

The schedule (:mod:`.soakplan`) is seeded and counted in requests; the
checks (:mod:`.soakchecks`) run at each quiet point (the schedule paused,
in-flight requests finished, the faults of the segment ended) and at the
end. Results: bench/results/soak.json and soak.png (a real run only, not
``--quick``). docs/soak.md has the whole description.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import http.client
import json
import os
import random
import signal
import statistics
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from kvstrata.bench import soakchecks as checks
from kvstrata.bench import soakplan
from kvstrata.bench.faultproxy import HttpFaultProxy, TcpFaultProxy
from kvstrata.bench.serve import QUICK, RESULTS_DIR, VllmServer
from kvstrata.bench.serve import Plan as ServePlan
from kvstrata.bench.soakhostile import HOSTILE, Hostile
from kvstrata.bench.supervisor import Supervisor

# bench serve's servers size their max model length per regime; the soak's
# prompts are shared prefixes plus suffixes, as in its "l1" regime.
SERVE_REGIME = "l1"

SHM_SIZE = "1g"  # the namespace's own /dev/shm (vLLM's queues and the arena)
SHM_LEFT_FREE = 24 << 20  # what "nearly full" leaves
SIDECAR_STOP_MIN_S = 6.0  # a SIGSTOP outlasts the connector's 0.5 s calls and 5 s loads
QUIET_TIMEOUT_S = 60.0
# The S3 tier's settings (the endpoint is the fault proxy's): short deadlines so
# a stalled or refusing endpoint costs a few seconds, not the default's.
S3_SETTINGS: dict[str, Any] = {
    "bucket": "soak",
    "create_bucket": True,
    "timeout_seconds": 2.0,
    "max_attempts": 2,
}
VLLM_KILL_WAIT_S = 10.0  # how long a vLLM kill waits for a moment with leases held
FLOOD_CONNECTIONS = 500  # open at once by the hostile client
AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "soak",
    "AWS_SECRET_ACCESS_KEY": "soak",
    "AWS_DEFAULT_REGION": "us-east-1",
}
DEFECTS = (
    "leaked_lease",
    "flipped_byte",
    "dropped_event",
    "duplicate_event",
    "leaked_segment",
    "failed_request",
    "stuck_writeback",
    "fd_leak",
)
RETRY_RULE = (
    "a request that fails while the schedule has killed vLLM itself (from the kill until the "
    "new server answers /health) is retried; every other failed or non-200 request is failed"
)


@dataclass(frozen=True)
class SoakPlan:
    seed: int = 0
    # About 14 minutes on this 2-core machine (docs/soak.md); ``--duration 43000``
    # for about 30. Each fault kind at least 3 times (the shared tiers' in their half).
    requests: int = 20000
    fault_free: int = 2000
    segments: int = 12
    per_segment: int = 1
    concurrency: int = 3
    users: int = 6
    prefix_lens: str = "128,256,384,512,640"
    suffix_len: int = 32
    output_len: int = 4
    chunk_size: int = 64
    l1_size: str = "1Mi"
    l2_tmpfs: str = "3m"
    l2_size: str = "2Mi"
    # The sidecar runs under prlimit with this many descriptors (soft and hard,
    # as a container runtime may set them): fd_flood goes beyond it. 0: unchanged.
    sidecar_nofile: int = 1024
    kinds: str = ",".join(k for k in soakplan.KINDS)


QUICK_SOAK = SoakPlan(requests=84, fault_free=12, segments=2, per_segment=1, users=4)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of its own are registered in bench.main (``--seed``, ``--duration``, ...)."""


# -- the namespace: private /dev/shm and the L2 tmpfs --------------------------------


class Namespace:
    """A mount namespace held by a sleeping process; children enter it with nsenter."""

    def __init__(self, l2_dir: Path, l2_size: str) -> None:
        l2_dir.mkdir(parents=True, exist_ok=True)
        script = (
            f"mount -t tmpfs -o size={SHM_SIZE} tmpfs /dev/shm && "
            f"mount -t tmpfs -o size={l2_size} tmpfs {l2_dir} && echo ok && exec sleep infinity"
        )
        self.proc = subprocess.Popen(
            ["unshare", "-m", "--propagation", "private", "sh", "-c", script],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if line.strip() != b"ok":
            self.proc.wait()
            raise RuntimeError(f"private mounts failed: {self.proc.stderr.read().decode()[-300:]}")  # type: ignore[union-attr]
        self.root = Path(f"/proc/{self.proc.pid}/root")
        self.l2_dir = l2_dir

    def prefix(self) -> list[str]:
        return ["nsenter", "-t", str(self.proc.pid), "-m", "--"]

    @property
    def shm(self) -> Path:
        return self.root / "dev/shm"

    def inside(self, path: Path) -> Path:
        return self.root / str(path).lstrip("/")

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


class NamespacedSidecar:
    """Builds the sidecar process class that starts inside the namespace."""

    @staticmethod
    def make(ns: Namespace | None, nofile: int = 0) -> type:
        from kvstrata.testing.sidecarproc import SIDECAR_COMMAND, SidecarProcess

        # prlimit execs the sidecar, so the pid the checks measure is still its own.
        limit = ["prlimit", f"--nofile={nofile}:{nofile}", "--"] if nofile else []

        class _Sidecar(SidecarProcess):
            extra_env = AWS_ENV

            def command(self) -> list[str]:
                return [*(ns.prefix() if ns else []), *limit, *SIDECAR_COMMAND]

        return _Sidecar


# -- prompts and references ------------------------------------------------------------


def prompts_for(plan: SoakPlan) -> list[list[int]]:
    """Per user and prefix length, one prompt: a shared prefix (one per length,
    common to all users) and the user's own suffix."""
    from kvstrata.testing.localstack import random_tokens

    lens = [int(x) for x in plan.prefix_lens.split(",")]
    out = []
    for li, n in enumerate(lens):
        prefix = random_tokens(n, seed=plan.seed * 1000 + li)
        for u in range(plan.users):
            suffix = random_tokens(plan.suffix_len, seed=plan.seed * 1000 + 100 + li * 50 + u)
            out.append(prefix + suffix)
    return out


def request_order(plan: SoakPlan, n_prompts: int) -> list[int]:
    rng = random.Random(plan.seed + 7)
    return [rng.randrange(n_prompts) for _ in range(plan.requests)]


def complete(
    url: str, model: str, prompt: list[int], max_tokens: int
) -> tuple[int, list[int], float, str]:
    """One streamed greedy completion: (status, token ids, TTFT s, error). A stream
    that ends without vLLM's closing ``data: [DONE]`` (the server died mid-reply)
    is no answer: status 0."""
    body = json.dumps(
        {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "return_token_ids": True,
        }
    ).encode()
    req = urllib.request.Request(
        url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    started = time.monotonic()
    ttft = 0.0
    tokens: list[int] = []
    done = False
    try:
        with urllib.request.urlopen(req, timeout=120) as reply:
            for raw in reply:
                line = raw.strip()
                if line == b"data: [DONE]":
                    done = True
                if not line.startswith(b"data: ") or done:
                    continue
                chunk = json.loads(line[6:])
                ids = chunk["choices"][0].get("token_ids") or []
                if ids and not tokens:
                    ttft = time.monotonic() - started
                tokens.extend(ids)
            if not done:
                return 0, tokens, ttft, f"stream ended without [DONE] after {len(tokens)} tokens"
            return reply.status, tokens, ttft, ""
    except urllib.error.HTTPError as exc:
        return exc.code, tokens, ttft, exc.read()[:300].decode(errors="replace")
    except (OSError, ValueError, KeyError, http.client.HTTPException) as exc:
        return 0, tokens, ttft, repr(exc)


def references(
    serve_plan: ServePlan, model: Path, prompts: list[list[int]], out: Path, max_tokens: int
) -> list[list[int]]:
    """Outputs of ``vllm serve`` without the connector; kept beside the model,
    keyed by model and prompts (recomputed when either changes)."""
    key = hashlib.sha256(json.dumps([str(model), prompts, max_tokens]).encode()).hexdigest()[:16]
    cache = model / f"soak-references-{key}.json"
    if cache.exists():
        return json.loads(cache.read_text())
    with VllmServer(serve_plan, SERVE_REGIME, model, out / "reference-vllm.log", None) as server:
        refs = []
        for p in prompts:
            status, tokens, _, error = complete(server.url, str(model), p, max_tokens)
            if status != 200 or len(tokens) != max_tokens:
                raise RuntimeError(f"reference run failed: {status} {error}")
            refs.append(tokens)
    cache.write_text(json.dumps(refs))
    return refs


# -- KV events ---------------------------------------------------------------------------


class EventListener:
    """Subscribes to one vLLM server's KV event publisher; records batch sequence numbers
    and counts kvstrata's own events (those whose medium is not the GPU's)."""

    def __init__(self, port: int, drop: int | None = None, duplicate: int | None = None) -> None:
        import zmq

        self.seqs: list[int] = []
        self.kvstrata_events = 0
        self.kinds: dict[str, int] = {}  # "BlockStored CPU" -> count
        self._drop, self._duplicate = drop, duplicate
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.setsockopt(zmq.RCVTIMEO, 200)
        self._sock.setsockopt(zmq.LINGER, 0)
        # vLLM's publisher connects to a ``tcp://host:port`` endpoint and binds only
        # ``tcp://*:port`` (vllm/distributed/kv_events.py, ZmqEventPublisher): the
        # listener binds, so it sees the first batch the server publishes.
        self._sock.bind(f"tcp://127.0.0.1:{port}")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="kv-events")
        self._thread.start()

    def _run(self) -> None:
        import msgpack
        import zmq

        while not self._stop.is_set():
            try:
                _topic, seq_bytes, payload = self._sock.recv_multipart()
            except zmq.Again:
                continue
            except zmq.ZMQError:
                return
            seq = int.from_bytes(seq_bytes, "big")
            n = len(self.seqs)
            if self._drop is not None and n == self._drop:  # injected defect: dropped_event
                self._drop = None
                continue
            self.seqs.append(seq)
            if self._duplicate is not None and n == self._duplicate:  # injected: duplicate_event
                self.seqs.append(seq)
                self._duplicate = None
            with contextlib.suppress(Exception):
                batch = msgpack.unpackb(payload, raw=False)
                for event in batch[1]:
                    # An event is a map with its class name in "type" (msgspec's tag):
                    # kvstrata's tier events carry medium CPU or STORAGE, vLLM's own
                    # blocks GPU (connector/events.py; vllm/distributed/kv_events.py).
                    name = f"{event.get('type')} {event.get('medium')}"
                    self.kinds[name] = self.kinds.get(name, 0) + 1
                    if event.get("medium") in ("CPU", "STORAGE"):
                        self.kvstrata_events += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close(0)


# -- the run -------------------------------------------------------------------------------


class Soak:
    def __init__(
        self, plan: SoakPlan, serve_plan: ServePlan, root: Path, defect: str | None, quick: bool
    ) -> None:
        self.plan, self.serve_plan, self.root, self.defect = plan, serve_plan, root, defect
        self.quick = quick
        kinds = [k for k in plan.kinds.split(",") if k]
        self.skipped: dict[str, str] = {
            k: "not among this run's kinds (--param kinds)"
            for k in soakplan.KINDS
            if k not in kinds
        }
        self.schedule = soakplan.build(
            plan.seed, plan.requests, plan.fault_free, plan.segments, kinds, plan.per_segment
        )
        self.injected: dict[str, int] = dict.fromkeys(soakplan.KINDS, 0)
        self.outcomes: list[checks.Outcome] = []
        self.timeline: list[dict[str, Any]] = []  # per request: t, ttft, phase
        self.fault_marks: list[dict[str, Any]] = []
        self.quiet: list[dict[str, Any]] = []
        self.problems: list[str] = []
        self.lock = threading.Lock()
        self.inflight = 0
        self.inflight_done = threading.Condition()
        self.vllm_generation = 0
        self.vllm_down = threading.Event()
        self.vllm_up = threading.Event()
        self.stop_started: float | None = None
        self.baseline: dict[str, int] | None = None
        self.listeners: list[EventListener] = []
        self.flood_stop: threading.Event | None = None
        self.hostiles: dict[str, Hostile] = {}  # kind -> the running hostile client
        self.hostile_reports: list[dict[str, Any]] = []
        self.hostile_checked = 0  # reports already checked at a quiet point
        self.fillers: dict[str, Path] = {}
        self.t0 = time.monotonic()
        self.leak_peer: Any = None
        self.bounds = self.resource_bounds()
        self.harness_error = ""
        self.vllm_killer: threading.Thread | None = None
        self.hits: list[dict[str, float]] = []  # sampled: cumulative hit and prompt tokens
        self.prompt_tokens = 0
        self.monitor_stop = threading.Event()
        self.sample_lock = threading.Lock()
        self.hits_last = self.hits_total = 0.0

    # -- setup ---------------------------------------------------------------------------

    def sidecar_config(self, shared: str) -> dict[str, Any]:
        if shared == "valkey":
            tier = {
                "backend": "valkey",
                "valkey": {"url": f"redis://127.0.0.1:{self.valkey_proxy.port}/0"},
            }
        else:
            tier = {
                "backend": "s3",
                "s3": {"endpoint_url": f"http://127.0.0.1:{self.s3_proxy.port}", **S3_SETTINGS},
            }
        return {
            "l2": {"path": str(self.l2_dir / "l2"), "size_bytes": self.plan.l2_size},
            "shared": tier,
            "server": {"client_timeout_seconds": 10.0, "lease_seconds": 5.0},
        }

    @staticmethod
    def resource_bounds() -> checks.Bounds:
        """The bounds, with what the S3 tier's pools may start and keep open as
        configured for this run (transfer and lookup threads, pooled connections)."""
        from kvstrata.sidecar.config import S3Config
        from kvstrata.sidecar.tiers.s3client import botocore_config, lookup_threads

        s3 = S3Config(**S3_SETTINGS)
        return checks.Bounds(
            s3_threads=s3.max_concurrency + lookup_threads(s3),
            s3_connections=botocore_config(s3).max_pool_connections,
        )

    def setup(self) -> None:
        from kvstrata.testing.servers import MotoS3Server, RedisServer
        from kvstrata.testing.tinymodel import build_tiny_llama

        sp = self.serve_plan
        self.model = build_tiny_llama(
            hidden_size=sp.hidden_size,
            num_layers=sp.num_layers,
            num_heads=sp.num_heads,
            num_kv_heads=sp.num_kv_heads,
            head_dim=sp.head_dim,
            dtype=sp.dtype,
            max_position_embeddings=8192,
        )
        self.prompts = prompts_for(self.plan)
        self.order = request_order(self.plan, len(self.prompts))
        self.references = references(sp, self.model, self.prompts, self.root, self.plan.output_len)
        self.valkey = RedisServer(self.root / "valkey").start()
        self.valkey_proxy = TcpFaultProxy(self.valkey.port)
        self.s3 = MotoS3Server().start()
        self.s3_proxy = HttpFaultProxy(self.s3.port)
        self.l2_dir = self.root / "l2mnt"
        try:
            self.ns: Namespace | None = Namespace(self.l2_dir, self.plan.l2_tmpfs)
        except (RuntimeError, OSError) as exc:
            self.ns = None
            for kind in ("l2_full", "shm_full"):
                self.skipped[kind] = f"no private mounts: {exc}"
        if not os.environ.get("KUBEBUILDER_ASSETS"):
            self.skipped["operator_restart"] = (
                "not applicable: no control plane (kvstrata.testing.controlplane needs "
                "KUBEBUILDER_ASSETS)"
            )
        cls = NamespacedSidecar.make(self.ns, self.plan.sidecar_nofile)
        self.sidecar = cls(
            self.root / "sc",
            chunk_size=self.plan.chunk_size,
            l1_size=self.plan.l1_size,
            l2_size=self.plan.l2_size,
            overrides=self.sidecar_config("valkey"),
        )
        self.shared = "valkey"
        self.supervisor = Supervisor(self.sidecar)
        self.supervisor.start()
        self.start_vllm()

    def start_vllm(self) -> None:
        from kvstrata.connector.transfer_config import kv_transfer_config
        from kvstrata.testing.servers import free_port

        connector = kv_transfer_config(self.sidecar.endpoint, chunk_size=self.plan.chunk_size)
        n = self.vllm_generation
        server = VllmServer(
            self.serve_plan, SERVE_REGIME, self.model, self.root / f"vllm-{n}.log", connector
        )
        events_port = free_port()
        server.argv += [
            "--kv-events-config",
            json.dumps(
                {
                    "enable_kv_cache_events": True,
                    "publisher": "zmq",
                    "endpoint": f"tcp://127.0.0.1:{events_port}",
                }
            ),
        ]
        if self.ns is not None:
            server.argv = [*self.ns.prefix(), *server.argv]
        drop = 3 if self.defect == "dropped_event" and n == 0 else None
        dup = 3 if self.defect == "duplicate_event" and n == 0 else None
        self.listeners.append(EventListener(events_port, drop, dup))
        self.vllm = server  # set first: close() stops a server still starting
        server.__enter__()

    def vllm_pids(self) -> set[int]:
        proc = self.vllm.proc
        if proc is None or proc.poll() is not None:
            return set()
        pids = {proc.pid}
        out = subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True, text=True)
        pids |= {int(x) for x in out.stdout.split()}
        return pids

    # -- faults ----------------------------------------------------------------------------

    def apply(self, fault: soakplan.Fault, begin: bool) -> None:
        kind = fault.kind
        if kind in self.skipped:
            return
        if begin:
            self.injected[kind] += 1
            self.fault_marks.append(
                {"kind": kind, "request": fault.start, "t": time.monotonic() - self.t0}
            )
        getattr(self, f"fault_{kind}")(fault, begin)

    def fault_sidecar_kill(self, fault: soakplan.Fault, begin: bool) -> None:
        self.sidecar.kill()  # the supervisor restarts it, after its backoff

    def fault_sidecar_stop(self, fault: soakplan.Fault, begin: bool) -> None:
        if not self.sidecar.running():
            self.supervisor.wait_running()
        if begin:
            self.sidecar.pause()
            self.stop_started = time.monotonic()
        else:
            left = SIDECAR_STOP_MIN_S - (time.monotonic() - (self.stop_started or 0))
            if left > 0:
                time.sleep(left)  # beyond every timeout of the connector
            self.sidecar.resume()

    def fault_vllm_kill(self, fault: soakplan.Fault, begin: bool) -> None:
        """From request ``start`` on, wait for a moment the sidecar holds leases
        (requests keep flowing meanwhile), then SIGKILL the whole server or only its
        engine core (seeded) and start a new server; the next quiet point waits
        for it."""
        mark = self.fault_marks[-1]
        self.vllm_killer = threading.Thread(
            target=self._kill_vllm, args=(fault, mark), daemon=True, name="vllm-killer"
        )
        self.vllm_killer.start()

    def _kill_vllm(self, fault: soakplan.Fault, mark: dict[str, Any]) -> None:
        try:
            self._kill_vllm_holding_leases(fault, mark)
        except Exception as exc:  # the harness broke: the run stops and fails
            self.harness_error = f"vLLM restart: {type(exc).__name__}: {exc}"
            self.vllm_down.clear()

    def _kill_vllm_holding_leases(self, fault: soakplan.Fault, mark: dict[str, Any]) -> None:
        proc = self.vllm.proc
        assert proc is not None
        core = subprocess.run(
            ["pgrep", "-f", "VLLM::EngineCore", "-g", str(proc.pid)],
            capture_output=True,
            text=True,
        ).stdout.split()
        # Leases live for milliseconds; a frozen engine core holds what it held.
        # Freeze it, look, and thaw it again until it is caught holding some.
        leases = 0
        rng = random.Random(fault.variant)
        deadline = time.monotonic() + VLLM_KILL_WAIT_S
        while core and time.monotonic() < deadline:
            os.kill(int(core[0]), signal.SIGSTOP)
            leases = self.sidecar_status().get("leases_active") or 0
            if leases:
                break
            os.kill(int(core[0]), signal.SIGCONT)
            time.sleep(rng.random() * 0.05)  # let it run a while between looks
        self.vllm_down.set()
        mark["leases_at_kill"] = leases
        victim = "server"
        if fault.variant % 2 and core:
            victim = "engine core"
            os.kill(int(core[0]), signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(30)  # the API server exits when its engine dies
        mark["victim"] = victim
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        self.vllm_generation += 1
        self.start_vllm()
        self.vllm_down.clear()

    def fault_valkey_kill(self, fault: soakplan.Fault, begin: bool) -> None:
        if begin:
            self.valkey.stop()
        else:
            self.valkey.start()

    def fault_valkey_pause(self, fault: soakplan.Fault, begin: bool) -> None:
        assert self.valkey.process is not None
        self.valkey.process.send_signal(signal.SIGSTOP if begin else signal.SIGCONT)

    def fault_valkey_full(self, fault: soakplan.Fault, begin: bool) -> None:
        import redis

        client = redis.Redis(port=self.valkey.port, socket_timeout=5)
        if begin:
            used = int(client.info("memory")["used_memory"])
            client.config_set("maxmemory", used)  # noeviction is set at start: writes fail OOM
        else:
            client.config_set("maxmemory", 0)
        client.close()

    def fault_valkey_partition(self, fault: soakplan.Fault, begin: bool) -> None:
        self.valkey_proxy.set_mode("partition" if begin else "pass")

    def fault_valkey_reset(self, fault: soakplan.Fault, begin: bool) -> None:
        self.valkey_proxy.set_mode("reset")
        self.valkey_proxy.set_mode("pass")

    def _s3_mode(self, mode: str, begin: bool) -> None:
        self.s3_proxy.set_mode(mode if begin else "pass")

    def fault_s3_503(self, fault: soakplan.Fault, begin: bool) -> None:
        self._s3_mode("http503", begin)

    def fault_s3_stall(self, fault: soakplan.Fault, begin: bool) -> None:
        self._s3_mode("stall", begin)

    def fault_s3_corrupt(self, fault: soakplan.Fault, begin: bool) -> None:
        self._s3_mode("corrupt", begin)

    def _fill(self, name: str, directory: Path, leave: int, begin: bool) -> None:
        filler = directory / f"soak-filler-{name}"
        if begin:
            st = os.statvfs(directory)
            size = max(0, st.f_bavail * st.f_frsize - leave)
            # tmpfs full before the last byte: fine
            with open(filler, "wb") as fh, contextlib.suppress(OSError):
                os.posix_fallocate(fh.fileno(), 0, size)
            self.fillers[name] = filler
        else:
            with contextlib.suppress(FileNotFoundError):
                filler.unlink()
            self.fillers.pop(name, None)

    def fault_l2_full(self, fault: soakplan.Fault, begin: bool) -> None:
        assert self.ns is not None
        self._fill("l2", self.ns.inside(self.l2_dir), 0, begin)

    def fault_shm_full(self, fault: soakplan.Fault, begin: bool) -> None:
        assert self.ns is not None
        if begin and self.vllm_killer is not None:
            # vLLM cannot start without room in /dev/shm (soakplan.KINDS): a
            # restart still under way when the schedule fills it finishes first.
            # The schedule keeps the two apart in requests, but a restart takes
            # as long as it takes while in-flight requests still count.
            self.vllm_killer.join()
            self.vllm_killer = None
        self._fill("shm", self.ns.shm, SHM_LEFT_FREE, begin)

    def fault_flood(self, fault: soakplan.Fault, begin: bool) -> None:
        """A hostile local client: new connections as fast as it can, each sending
        garbage and a HELLO, never closing until the fault ends."""
        if not begin:
            assert self.flood_stop is not None
            self.flood_stop.set()
            return
        stop = threading.Event()
        self.flood_stop = stop

        def flood() -> None:
            import zmq

            ctx = zmq.Context()
            socks = []
            try:
                # Below the context's own socket cap (zmq's default max_sockets, 1023).
                while not stop.is_set() and len(socks) < FLOOD_CONNECTIONS:
                    s = ctx.socket(zmq.DEALER)
                    s.setsockopt(zmq.LINGER, 0)
                    s.connect(self.sidecar.endpoint)
                    socks.append(s)
                    with contextlib.suppress(zmq.ZMQError):
                        s.send(b"\xc1not msgpack", zmq.NOBLOCK)
                    time.sleep(0.002)
                stop.wait()
            finally:
                for s in socks:
                    s.close(0)
                ctx.term()

        threading.Thread(target=flood, daemon=True, name="flood").start()

    def fault_fd_flood(self, fault: soakplan.Fault, begin: bool) -> None:
        self._hostile(fault, begin)

    def fault_unread_reader(self, fault: soakplan.Fault, begin: bool) -> None:
        self._hostile(fault, begin)

    def fault_lease_hog(self, fault: soakplan.Fault, begin: bool) -> None:
        self._hostile(fault, begin)

    def _hostile(self, fault: soakplan.Fault, begin: bool) -> None:
        """Start or stop one of :mod:`.soakhostile`'s clients; what it did goes
        to the JSON (``hostile_clients``)."""
        if begin:
            client = HOSTILE[fault.kind](self.sidecar.endpoint, self.sidecar.http_port)
            self.hostiles[fault.kind] = client.start()
            return
        self._end_hostile(fault.kind, fault.start)

    def _end_hostile(self, kind: str, start: int | None) -> None:
        client = self.hostiles.pop(kind, None)
        if client is not None:
            client.stop()
            self.hostile_reports.append({"kind": kind, "request": start, **client.report()})

    def fault_operator_restart(self, fault: soakplan.Fault, begin: bool) -> None:
        raise NotImplementedError("needs a control plane")  # skipped in setup without one

    def heal_all(self) -> None:
        """End every fault still in effect (the end of the run, or an error)."""
        self.valkey_proxy.set_mode("pass")
        self.s3_proxy.set_mode("pass")
        if self.valkey.process is not None:
            with contextlib.suppress(ProcessLookupError):
                self.valkey.process.send_signal(signal.SIGCONT)
        if self.sidecar.proc is not None and self.sidecar.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.sidecar.resume()
        for filler in list(self.fillers.values()):
            with contextlib.suppress(FileNotFoundError):
                filler.unlink()
        if self.flood_stop is not None:
            self.flood_stop.set()
        for kind in list(self.hostiles):
            self._end_hostile(kind, None)

    # -- load ------------------------------------------------------------------------------

    def worker(self) -> None:
        try:
            self._work()
        except Exception as exc:  # the harness itself broke: the run stops and fails
            self.harness_error = f"{type(exc).__name__}: {exc}"
            self.vllm_down.clear()  # no client waits for a server that will not come

    def _work(self) -> None:
        while True:
            with self.lock:
                i = len(self.issued)
                if i >= self.plan.requests or self.harness_error:
                    return
                if i in self.quiet_at:
                    self.quiet_point(i)
                ending, starting = self.schedule.at(i)
                for f in ending:
                    self.apply(f, begin=False)
                for f in starting:
                    self.apply(f, begin=True)
                self.issued.append(i)
                with self.inflight_done:
                    self.inflight += 1
            try:
                self.one_request(i)
            finally:
                with self.inflight_done:
                    self.inflight -= 1
                    self.inflight_done.notify_all()

    def one_request(self, i: int) -> None:
        prompt = self.order[i]
        retried = 0
        while True:
            generation = self.vllm_generation
            started = time.monotonic() - self.t0
            status, tokens, ttft, error = complete(
                self.vllm.url, str(self.model), self.prompts[prompt], self.plan.output_len
            )
            if status == 200:
                break
            if self.vllm_down.is_set() or generation != self.vllm_generation:
                retried += 1  # vLLM's own restart window (module docstring): try again
                while self.vllm_down.is_set():
                    time.sleep(0.2)
                continue
            break
        if self.defect == "failed_request" and i == 2:
            status, error = 500, "injected defect: failed_request"
        outcome = checks.Outcome(i, prompt, status, tuple(tokens), error, retried)
        with self.inflight_done:
            self.outcomes.append(outcome)
            self.prompt_tokens += len(self.prompts[prompt])
            self.timeline.append(
                {
                    "request": i,
                    "t": started,
                    "ttft_s": ttft,
                    "status": status,
                    "fault_free": i < self.plan.fault_free,
                    "prompt_tokens": len(self.prompts[prompt]),
                }
            )

    # -- observation -------------------------------------------------------------------------

    def sidecar_status(self) -> dict[str, Any]:
        try:
            return self.sidecar.status()
        except (OSError, ValueError):
            return {}

    def monitor(self) -> None:
        """Sample the sidecar's hit tokens once a second, summed across its restarts
        (a counter that went down belongs to a new process and counts from 0)."""
        while not self.monitor_stop.wait(1.0):
            self.sample_hits()

    def sample_hits(self) -> None:
        value = self.hit_tokens(timeout=0.5)
        with self.sample_lock:
            if value < 0:
                return
            last = self.hits_last
            self.hits_total += value - last if value >= last else value
            self.hits_last = value
            self.hits.append(
                {
                    "t": time.monotonic() - self.t0,
                    "hit_tokens": self.hits_total,
                    "prompt_tokens": float(self.prompt_tokens),
                }
            )

    def hit_tokens(self, timeout: float = 5.0) -> float:
        try:
            with urllib.request.urlopen(self.sidecar.url("/metrics"), timeout=timeout) as reply:
                text = reply.read().decode()
        except (OSError, ValueError):
            return -1.0
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("kvstrata_hit_tokens_total{")
        )

    def poll(self, what: str, check: Any, timeout: float = QUIET_TIMEOUT_S) -> list[str]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                problems = check()
            except (OSError, ValueError, KeyError) as exc:
                problems = [f"{what}: {exc!r}"]
            if not problems or time.monotonic() > deadline:
                return problems
            time.sleep(0.25)

    def quiet_point(self, at: int, final: bool = False) -> None:
        """Pause, let in-flight requests finish, run every check (module docstring)."""
        if self.vllm_killer is not None:
            self.vllm_killer.join()
            self.vllm_killer = None
        with self.inflight_done:
            self.inflight_done.wait_for(lambda: self.inflight == 0)
        self.supervisor.wait_running()
        record: dict[str, Any] = {"request": at, "t": time.monotonic() - self.t0, "final": final}
        found: dict[str, list[str]] = {}
        found["requests"] = checks.requests_check(self.outcomes, at)
        found["outputs"] = checks.outputs_check(self.outcomes, self.references)
        found["ready"] = self.poll(
            "sidecar ready", lambda: [] if self.sidecar._ready() else ["not ready"]
        )
        if self.defect == "leaked_lease" and self.leak_peer is None:
            self.leak_peer = leak_a_lease(self.sidecar.endpoint)
        found["leases"] = self.poll("leases", lambda: checks.leases_check(self.sidecar.status()))
        live = self.vllm_pids() | ({os.getpid()} if self.leak_peer else set())
        found["clients"] = self.poll(
            "clients", lambda: checks.clients_check(self.sidecar.status(), live)
        )
        status = self.sidecar_status()
        arena = status.get("arena", {}).get("name", "")
        shm = self.ns.shm if self.ns else Path("/dev/shm")
        if self.defect == "flipped_byte" and at == self.plan.fault_free and arena:
            flip_arena(shm / arena)
        if self.defect == "leaked_segment":
            (shm / "kvstrata-injected-defect").write_bytes(b"x")
        if self.ns is not None:
            found["segments"] = self.poll("segments", lambda: checks.segments_check(shm, {arena}))
        found["mappers"] = checks.mappers_check(
            Path("/proc"), arena, live | {self.sidecar.proc.pid}
        )  # type: ignore[union-attr]
        metrics = lambda: self.sidecar.get("/metrics")  # noqa: E731
        if self.defect == "stuck_writeback":
            metrics = lambda: 'kvstrata_write_queue_depth{tier="l2"} 3.0'  # noqa: E731
        found["writeback"] = self.poll("write-behind", lambda: checks.writeback_check(metrics()))

        def measure() -> dict[str, int]:
            now = checks.resources(self.sidecar.proc.pid)  # type: ignore[union-attr]
            if self.defect == "fd_leak" and self.baseline is not None:
                # One descriptor more than allowed over the baseline, however
                # many the sidecar happens to hold now.
                leaked = max(now["fds"], self.baseline["fds"]) + 1
                now = {**now, "fds": leaked + self.bounds.allowed("fds", self.shared)}
            return now

        now = measure()
        if self.baseline is None:
            self.baseline = now
        baseline = self.baseline
        found["resources"] = self.poll(  # a flood's connections take a moment to close
            "resources",
            lambda: checks.resources_check(measure(), baseline, self.bounds, self.shared),
        )
        found["events"] = checks.events_check([lst.seqs for lst in self.listeners])
        found["hostile"] = checks.hostile_check(
            self.hostile_reports[self.hostile_checked :], self.bounds.allowed("rss_bytes", "")
        )
        self.hostile_checked = len(self.hostile_reports)
        found["exits"] = checks.exits_check(
            list(self.supervisor.exits), self.injected["sidecar_kill"]
        )
        record["resources"] = now
        record["leases_active"] = status.get("leases_active")
        self.sample_hits()
        record["hit_tokens"] = self.hits_total
        record["problems"] = {k: v[:5] for k, v in found.items() if v}
        self.quiet.append(record)
        for name, problems in found.items():
            self.problems += [f"at request {at}, {name}: {p}" for p in problems[:5]]
        # A tier change is a config rollout: the sidecar restarts with the new config.
        seg = next((s for s in self.schedule.segments if s.start == at), None)
        if seg is not None and seg.shared != self.shared and not final:
            self.switch_shared(seg.shared)

    def switch_shared(self, shared: str) -> None:
        import yaml

        self.supervisor.hold()
        self.sidecar.stop()
        config = yaml.safe_load(self.sidecar.config_path.read_text())
        config["shared"] = self.sidecar_config(shared)["shared"]
        self.sidecar.config_path.write_text(yaml.safe_dump(config))
        self.shared = shared
        self.supervisor.wait_running()
        self.supervisor.release()

    # -- the whole -----------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        self.issued: list[int] = []
        self.quiet_at = set(self.schedule.quiet_points()[:-1])
        self.t0 = time.monotonic()  # the timeline starts with the load
        self.sample_hits()
        threads = [
            threading.Thread(target=self.worker, name=f"user-{n}")
            for n in range(self.plan.concurrency)
        ]
        monitor = threading.Thread(target=self.monitor, daemon=True, name="monitor")
        monitor.start()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.monitor_stop.set()
        monitor.join()
        if self.harness_error:
            self.problems.append(f"the soak itself failed: {self.harness_error}")
        with self.lock:
            self.heal_all()
            self.quiet_point(self.plan.requests, final=True)
            # The clients go: vLLM stops; its sessions and leases must go with it.
            self.vllm.stop()
            if self.leak_peer is not None:
                keep = self.leak_peer
            end: dict[str, list[str]] = {}
            end["leases"] = self.poll("leases", lambda: checks.leases_check(self.sidecar.status()))
            end["clients"] = self.poll(
                "clients",
                lambda: checks.clients_check(
                    self.sidecar.status(), {os.getpid()} if self.leak_peer else set()
                ),
            )
            arena = self.sidecar_status().get("arena", {}).get("name", "")
            end["mappers"] = checks.mappers_check(Path("/proc"), arena, {self.sidecar.proc.pid})  # type: ignore[union-attr]
            self.supervisor.hold()
            self.sidecar.stop()
            if self.ns is not None:
                end["segments_after_stop"] = checks.segments_check(self.ns.shm, set())
            for name, problems in end.items():
                self.problems += [f"after vLLM stopped, {name}: {p}" for p in problems[:5]]
            if self.leak_peer is not None:
                keep.close()
        return self.result()

    def result(self) -> dict[str, Any]:
        free = [r["ttft_s"] for r in self.timeline if r["fault_free"] and r["status"] == 200]
        faulty = [r["ttft_s"] for r in self.timeline if not r["fault_free"] and r["status"] == 200]
        failed = [o for o in self.outcomes if o.status != 200]
        differing = checks.outputs_check(self.outcomes, self.references)
        per_kind = {k: v for k, v in self.injected.items() if k not in self.skipped}
        free_end = next(q["t"] for q in self.quiet if q["request"] == self.plan.fault_free)
        hit_rate = {
            "fault_free": _rate(self.hits, 0.0, free_end),
            "under_faults": _rate(self.hits, free_end, float("inf")),
            "definition": "kvstrata hit tokens (sidecar's kvstrata_hit_tokens_total, summed "
            "across restarts) over prompt tokens sent",
        }
        return {
            "seed": self.plan.seed,
            "plan": asdict(self.plan),
            "model": {
                k: getattr(self.serve_plan, k)
                for k in (
                    "hidden_size",
                    "num_layers",
                    "num_heads",
                    "num_kv_heads",
                    "head_dim",
                    "dtype",
                    "kv_cap_tokens",
                )
            },
            "availability_rule": RETRY_RULE,
            "injected_defect": self.defect,
            "requests": len(self.outcomes),
            "failed_requests": len(failed),
            "retried_in_vllm_restart": sum(o.retried_in_vllm_restart for o in self.outcomes),
            "differing_outputs": len(differing),
            "faults_injected": per_kind,
            "faults_skipped": self.skipped,
            "sidecar_restarts": self.supervisor.restarts,
            "vllm_restarts": self.vllm_generation,
            "kv_events": {
                "batches": [len(lst.seqs) for lst in self.listeners],
                "kvstrata_events": sum(lst.kvstrata_events for lst in self.listeners),
                "kinds": [lst.kinds for lst in self.listeners],
            },
            "ttft_fault_free_s": _pcts(free),
            "ttft_under_faults_s": _pcts(faulty),
            "hit_rate": hit_rate,
            "hit_samples": self.hits,
            "resource_bounds": asdict(self.bounds),
            "quiet_points": self.quiet,
            "fault_marks": self.fault_marks,
            "hostile_clients": self.hostile_reports,
            "timeline": self.timeline,
            "kv_event_seqs": [lst.seqs for lst in self.listeners],
            "outputs": [[o.index, o.prompt, list(o.tokens)] for o in self.outcomes],
            "schedule": self.schedule.to_json(),
            "problems": self.problems,
            "passed": not self.problems,
            "proxies": {
                "valkey_connections": self.valkey_proxy.connections_total,
                "s3_connections": self.s3_proxy.connections_total,
                "s3_corrupted_replies": self.s3_proxy.corrupted_total,
                "s3_503_replies": self.s3_proxy.refused_total,
            },
        }

    def close(self) -> None:
        for step in (
            lambda: self.heal_all(),
            lambda: self.supervisor.close(),
            lambda: self.vllm.stop(),
            lambda: self.sidecar.cleanup(),
            lambda: self.valkey.stop(),
            lambda: self.s3.stop(),
            lambda: self.valkey_proxy.close(),
            lambda: self.s3_proxy.close(),
            lambda: [lst.close() for lst in self.listeners],
            lambda: self.ns.close() if self.ns else None,
        ):
            with contextlib.suppress(Exception):
                step()


def flip_arena(path: Path) -> None:
    """Injected defect ``flipped_byte``: every byte of the L1 arena flipped behind the
    sidecar's back, so what it serves from L1 next is not what was stored."""
    import mmap

    with open(path, "r+b") as fh, mmap.mmap(fh.fileno(), 0) as mem:
        data = bytearray(mem[:])
        for i in range(len(data)):
            data[i] ^= 0x55
        mem[:] = bytes(data)


def leak_a_lease(endpoint: str) -> Any:
    """Injected defect ``leaked_lease``: a client that takes a store lease and
    never commits nor releases it, and keeps its session alive."""
    from kvstrata.sidecar import protocol as p
    from kvstrata.sidecar.keys import FINGERPRINT_BYTES
    from kvstrata.testing.rawpeer import RawPeer

    peer = RawPeer(endpoint)
    fingerprint = b"\x01" * FINGERPRINT_BYTES
    peer.hello(fingerprint, client_id="injected-defect")
    stop = threading.Event()

    def hold() -> None:
        n = 0
        while not stop.is_set():
            n += 1
            key = fingerprint + n.to_bytes(8, "big") * 4  # a key names its namespace first
            with contextlib.suppress(Exception):
                peer.call(
                    p.PREPARE_STORE,
                    {"keys": [key], "nbytes": 64, "dtype": "uint8", "shape": [64], "owner": "leak"},
                    request_id=n,
                )
            stop.wait(1.0)

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()

    class _Leak:
        def close(self) -> None:
            stop.set()
            thread.join(5)
            peer.close()

    return _Leak()


def _rate(samples: list[dict[str, float]], start: float, end: float) -> float | None:
    inside = [s for s in samples if start <= s["t"] <= end]
    before = [s for s in samples if s["t"] < start]
    if not inside:
        return None
    first = before[-1] if before else {"hit_tokens": 0.0, "prompt_tokens": 0.0}
    prompts = inside[-1]["prompt_tokens"] - first["prompt_tokens"]
    return (inside[-1]["hit_tokens"] - first["hit_tokens"]) / prompts if prompts else None


def _pcts(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None, "n": 0}
    ordered = sorted(values)
    return {
        "p50": statistics.median(ordered),
        "p99": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
        "n": len(ordered),
    }


def plan_from(args: argparse.Namespace) -> tuple[SoakPlan, ServePlan]:
    plan = QUICK_SOAK if getattr(args, "quick", False) else SoakPlan()
    if getattr(args, "seed", None) is not None:
        plan = replace(plan, seed=args.seed)
    if getattr(args, "duration", None):
        n = int(args.duration)
        plan = replace(plan, requests=n, fault_free=max(8, n // 10))
    types = {f.name: type(getattr(plan, f.name)) for f in fields(SoakPlan)}
    for item in getattr(args, "param", None) or []:
        key, sep, value = item.partition("=")
        if not sep or key not in types:
            raise SystemExit(f"--param {item!r}: expected KEY=VALUE, KEY one of {sorted(types)}")
        try:
            plan = replace(plan, **{key: types[key](value)})
        except ValueError as exc:
            raise SystemExit(f"--param {item!r}: {exc}") from exc
    serve = replace(
        QUICK,
        kv_cap_tokens=1024,
        output_len=plan.output_len,
        prefix_len=max(int(x) for x in plan.prefix_lens.split(",")),
        suffix_len=plan.suffix_len,
        seed=0,
    )
    return plan, serve


def run(args: argparse.Namespace) -> dict[str, Any]:
    plan, serve_plan = plan_from(args)
    defect = getattr(args, "inject_defect", None)
    if defect is not None and defect not in DEFECTS:
        raise SystemExit(f"--inject-defect {defect!r}: one of {list(DEFECTS)}")
    print(f"soak seed {plan.seed}, {plan.requests} requests", flush=True)
    kept = os.environ.get("KVSTRATA_BENCH_WORKDIR")
    if kept:
        Path(kept).mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="soak-", dir=kept or None))
    soak = Soak(plan, serve_plan, root, defect, bool(args.quick))
    try:
        soak.setup()
        out = soak.run()
    finally:
        soak.close()
    out["workdir"] = str(root)
    if not args.quick and defect is None:
        RESULTS_DIR.mkdir(exist_ok=True)
        # The record committed is the summary: the per-request lists of a
        # 30-minute run are megabytes (``--out`` writes the whole of it).
        summary = {k: v for k, v in out.items() if k not in PER_REQUEST_RECORDS}
        (RESULTS_DIR / "soak.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
        plot(summary, RESULTS_DIR / "soak.png")
    return out


PER_REQUEST_RECORDS = ("timeline", "outputs", "kv_event_seqs", "hit_samples")


def plot(result: dict[str, Any], path: Path) -> None:
    """``soak.png`` from the summary (see :mod:`kvstrata.bench.plots`, which also
    redraws it from the committed JSON)."""
    from kvstrata.bench.plots import save, soak_figure

    save(soak_figure(result), path)


def format_table(result: dict[str, Any]) -> str:
    lines = [
        f"seed {result['seed']}: {result['requests']} requests, "
        f"{result['failed_requests']} failed, "
        f"{result['differing_outputs']} differing outputs, "
        f"{result['retried_in_vllm_restart']} retried in vLLM's own restart window",
        f"TTFT p50/p99 fault-free {result['ttft_fault_free_s']}, under faults "
        f"{result['ttft_under_faults_s']}",
        "faults: " + ", ".join(f"{k} {v}" for k, v in result["faults_injected"].items()),
        f"skipped: {result['faults_skipped']}",
        "PASSED" if result["passed"] else "FAILED:\n  " + "\n  ".join(result["problems"][:40]),
    ]
    return "\n".join(lines)
