"""Loads vLLM lets finish in the background (``load_kv_async``).

Why: a hit that reaches below L1 -- L2 on local disk, Valkey, S3 -- must
first come up into the arena, which can take from milliseconds to the
whole load deadline. Loaded inline, that wait sits inside vLLM's step and
delays every request in the batch. Loaded asynchronously, vLLM parks the
request (``WAITING_FOR_REMOTE_KVS``) with its blocks allocated, keeps
running the others, and schedules it once every worker has reported it
through ``get_finished``.

How: one daemon thread per worker with a sidecar session of its own (a read
that waits for a promotion never holds the socket the step's own calls
use), whose call deadline is the whole ``load_timeout_seconds``. The thread
sets its session up before it takes any job (HELLO, the arena mapped and,
on CUDA, registered for DMA): the worker starts it when vLLM registers its
KV, so a new replica's first parked request does not wait for that. The async
loads of one step are one job, leased and copied in waves of about
:data:`WAVE_BYTES` (one PREPARE_RETRIEVE per wave, one run per request, so a
wave's copy overlaps the landing of the next): the copies into vLLM's KV --
inline on the CPU; on a CUDA stream of our own that first waits for what
vLLM had queued when the step began, then synchronised -- then the leases
released, and each request reported finished. In ipc mode the session
registers the same KV handles and the sidecar does the copies (one
LOAD_BLOCKS per job, done when it answers).

While a job is in flight, a step in which vLLM scheduled nothing waits for
its report a moment instead of spinning (``KVStrataWorker.take_finished``).

Failures: every request handed in is reported finished exactly once,
whatever happens (vLLM holds its blocks until then, an aborted request's
too). With one KV cache group, the blocks not filled are reported as load
errors in the same pass (vLLM keeps the loaded prefix and recomputes the
rest). With several groups, vLLM cannot map block ids back to requests, so
a request missing anything is reported as a failed receive and recomputed
whole.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from kvstrata.connector import ipc
from kvstrata.connector.device import CudaCopies
from kvstrata.connector.layout import scatter_on_host

if TYPE_CHECKING:
    from collections.abc import Sequence

    from kvstrata.connector.client import SidecarClient
    from kvstrata.connector.leased_reads import Sources
    from kvstrata.connector.metadata import RequestTransfer
    from kvstrata.connector.transfer_path import CopyIn, TransferPath

logger = logging.getLogger(__name__)

CLOSE_JOIN_S = 5.0  # how long close() waits for a job in flight
# A background load leases and copies this many bytes of chunks at a time
# (:meth:`AsyncLoads._load_in_waves`): on this VM's Valkey (about 1 GB/s) a
# wave lands in some 30 ms, and its copy (a few ms) hides behind the next.
WAVE_BYTES = 32 << 20


@dataclass(slots=True)
class LoadOutcome:
    """What became of one request's load."""

    req_id: str
    loaded_chunks: int
    failed_chunks: int
    failed_blocks: set[int] = field(default_factory=set)  # vLLM recomputes these
    whole: bool = False  # nothing of it can be trusted: vLLM recomputes the request


@dataclass(slots=True)
class FinishedLoads:
    """Loads finished since the last :meth:`LoadReports.take`."""

    req_ids: set[str] = field(default_factory=set)  # every one of them, failed or not
    failed_req_ids: set[str] = field(default_factory=set)  # to recompute whole
    failed_blocks: set[int] = field(default_factory=set)  # to recompute (one group)
    loaded_chunks: int = 0
    failed_chunks: int = 0
    seconds: float = 0.0


@dataclass(slots=True)
class _Job:
    reqs: list[RequestTransfer]
    after: Any = None  # a CUDA event recorded on vLLM's stream when the step began
    after_handle: bytes | None = None  # ipc mode: that event's interprocess handle


def outcome_of(req: RequestTransfer, loaded: int) -> LoadOutcome:
    """The outcome of ``req`` when its first ``loaded`` chunks were copied."""
    failed = req.chunks[loaded:]
    blocks = {b for chunk in failed for b in chunk.block_ids[chunk.first_block :]}
    return LoadOutcome(req.req_id, loaded, len(failed), blocks, whole=req.plan_failed)


class LoadReports:
    """Finished loads waiting for vLLM's next ``get_finished``; thread-safe.

    ``whole_requests``: several KV cache groups, where a request missing
    anything is a failed receive (module docstring)."""

    def __init__(self, whole_requests: bool = False) -> None:
        self.whole_requests = whole_requests
        self._lock = threading.Lock()
        self._done = FinishedLoads()
        self._reported = threading.Event()  # set while ``_done`` holds a report

    def report(self, outcomes: Sequence[LoadOutcome], seconds: float = 0.0) -> None:
        with self._lock:
            done = self._done
            for o in outcomes:
                done.req_ids.add(o.req_id)
                done.loaded_chunks += o.loaded_chunks
                done.failed_chunks += o.failed_chunks
                if o.whole or (o.failed_chunks and self.whole_requests):
                    done.failed_req_ids.add(o.req_id)
                else:
                    done.failed_blocks |= o.failed_blocks
            done.seconds += seconds
            self._reported.set()

    def take(self) -> FinishedLoads:
        with self._lock:
            done, self._done = self._done, FinishedLoads()
            self._reported.clear()
        return done

    def wait(self, timeout: float) -> bool:
        """Wait (without the GIL) until a report is there to take, at most ``timeout``."""
        return self._reported.wait(timeout)


class AsyncLoads:
    """The worker's background loads (module docstring); ``submit`` is
    called from vLLM's worker thread, outcomes go to ``reports``. ``path``:
    how chunks move on the loader's own session (its client and copies are
    this object's from now on)."""

    def __init__(
        self,
        path: TransferPath,
        load_timeout_s: float,
        reports: LoadReports,
        wave_bytes: int = WAVE_BYTES,
    ) -> None:
        self.path = path
        self.load_timeout_s = load_timeout_s
        self.reports = reports
        self.wave_bytes = wave_bytes
        self._device = path.layouts[0].device
        copies = path.copies
        self._stream = copies.stream if isinstance(copies, CudaCopies) else None
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._in_flight = 0  # jobs submitted and not yet reported
        self._count_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="kvstrata-loads", daemon=True)
        self._thread.start()

    def submit(self, reqs: list[RequestTransfer]) -> None:
        """Load ``reqs`` in the background (one job)."""
        if not reqs:
            return
        try:
            after, handle = self._after_queued_work()
        except Exception:
            # A CUDA error here (create, record or export) must cost vLLM a
            # recompute of these requests, never an exception in its step.
            logger.exception("kvstrata: cannot order a background load after vLLM's work")
            self.reports.report([outcome_of(r, 0) for r in reqs])
            return
        with self._count_lock:
            self._in_flight += 1
        self._jobs.put(_Job(list(reqs), after, handle))

    def _after_queued_work(self) -> tuple[Any, bytes | None]:
        """An event recorded on vLLM's stream now (and its interprocess handle
        in ipc mode): the load's copies wait for it, as vLLM may still have
        work queued on the blocks it fills."""
        if self.path.sidecar_copies and self._device.type == "cuda":
            # The sidecar scatters into our blocks: after the work vLLM queued.
            return ipc.compute_done_event()
        if self._stream is not None:
            after = torch.cuda.Event()
            after.record(torch.cuda.current_stream(self._device))
            return after, None
        return None, None

    def in_flight(self) -> bool:
        """Whether a job submitted here has not been reported yet."""
        return self._in_flight > 0

    def close(self) -> None:
        """Stop the thread (after the job in flight, if any) and close the session."""
        self._jobs.put(None)
        self._thread.join(timeout=CLOSE_JOIN_S)
        self.path.close()
        self.path.client.close()

    # -- the loader thread ------------------------------------------------------

    @property
    def client(self) -> SidecarClient:
        return self.path.client

    def _set_up(self) -> None:
        """Connect and map the arena now (a sidecar not up yet: the first job retries)."""
        try:
            if self.path.client.ping():
                self.path.arena.tensor()
        except Exception:  # never fatal: the first job sets the session up again
            logger.exception("kvstrata: the background loader could not set its session up")

    def _run(self) -> None:
        self._set_up()
        while True:
            job = self._jobs.get()
            if job is None:
                return
            started = time.perf_counter()
            try:
                outcomes = self._load(job)
            except Exception:  # a bug here must cost a recompute, never a stuck request
                logger.exception("kvstrata: a background load failed; vLLM recomputes it")
                outcomes = [outcome_of(req, 0) for req in job.reqs]
            with self._count_lock:  # before the report: a waiter then sees it done
                self._in_flight -= 1
            self.reports.report(outcomes, time.perf_counter() - started)

    def _load(self, job: _Job) -> list[LoadOutcome]:
        deadline = time.monotonic() + self.load_timeout_s

        def copy_in(work: Sources) -> None:
            self._copy_in(work, job.after)

        try:
            if self.path.sidecar_copies:  # ipc: the sidecar copies the whole job
                loaded = self.path.load(job.reqs, deadline, copy_in, job.after_handle)
            else:
                loaded = self._load_in_waves(job.reqs, deadline, copy_in)
        finally:
            self.path.release_loaded()  # the copies are done (synchronised on CUDA)
        return [outcome_of(r, n) for r, n in zip(job.reqs, loaded, strict=True)]

    def _load_in_waves(
        self, reqs: Sequence[RequestTransfer], deadline: float, copy_in: CopyIn
    ) -> list[int]:
        """Lease and copy the job a wave at a time (``wave_bytes`` of each
        request's chunks, in order); per request, its leading chunks copied.

        Why: a PREPARE_RETRIEVE answers once all its chunks are in L1, and the
        chunks of a hit below L1 land one after the other (the lookup started
        their promotion). One call for the whole job copied nothing until the
        last chunk had landed; in waves, each wave's copy runs while the
        sidecar still fetches the next. A request that comes back short (a
        miss, a refused slot) ends there: later waves skip it."""
        per_wave = max(1, self.wave_bytes // max(g.chunk_nbytes for g in self.path.layouts))
        loaded = [0] * len(reqs)
        going = list(range(len(reqs)))
        for start in range(0, max((len(r.chunks) for r in reqs), default=0), per_wave):
            wave = [(i, reqs[i].chunks[start : start + per_wave]) for i in going]
            wave = [(i, chunks) for i, chunks in wave if chunks]
            if not wave:
                break
            got = self.path.load(
                [replace(reqs[i], chunks=chunks) for i, chunks in wave], deadline, copy_in
            )
            for (i, _), n in zip(wave, got, strict=True):
                loaded[i] += n
            going = [i for (i, chunks), n in zip(wave, got, strict=True) if n == len(chunks)]
        return loaded

    def _copy_in(self, work: Sources, after: Any) -> None:
        layouts = self.path.layouts
        if self._stream is None:  # CPU: inline, while vLLM computes other blocks
            scatter_on_host(layouts, work)
            return
        if after is not None:
            self._stream.wait_event(after)
        with torch.cuda.stream(self._stream):
            for chunk, src in work:
                layouts[chunk.group].scatter(src, chunk.block_ids, chunk.first_block)
        self._stream.synchronize()
