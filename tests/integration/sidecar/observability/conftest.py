"""A real Prometheus server for the observability tests.

Debian's ``prometheus`` package (``make system-deps`` installs it) runs as a
child process on loopback with a throwaway TSDB, scraping the targets a test
names every second. Each target gets the ``namespace`` and ``pod`` labels that
the Prometheus Operator adds to what a ServiceMonitor scrapes, so the
dashboard's template variables select the same series they select in a
cluster.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvstrata.testing.poll import wait_until

SCRAPE_INTERVAL_S = 1
START_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Target:
    """One scrape target: ``host:port`` and the labels the ServiceMonitor would add."""

    job: str
    address: str
    namespace: str
    pod: str
    # More labels a ServiceMonitor's relabelings add (the sidecars' kvcache).
    extra: tuple[tuple[str, str], ...] = ()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Prometheus:
    """A ``prometheus`` process scraping ``targets``; queried through its HTTP API."""

    def __init__(
        self, root: Path, targets: list[Target], rule_files: tuple[Path, ...] = ()
    ) -> None:
        binary = shutil.which("prometheus")
        if binary is None:
            pytest.fail("no prometheus binary: run `make system-deps` (Debian package prometheus)")
        self.root = root
        self.port = _free_port()
        root.mkdir(parents=True, exist_ok=True)
        config = root / "prometheus.yml"
        config.write_text(yaml.safe_dump(self._config(targets, rule_files)))
        self._log = open(root / "prometheus.log", "wb")  # noqa: SIM115 -- closed in stop()
        self._proc = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={root / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    @staticmethod
    def _config(targets: list[Target], rule_files: tuple[Path, ...]) -> dict[str, Any]:
        jobs: dict[str, list[dict[str, Any]]] = {}
        for t in targets:
            labels = {"namespace": t.namespace, "pod": t.pod, **dict(t.extra)}
            jobs.setdefault(t.job, []).append({"targets": [t.address], "labels": labels})
        return {
            "global": {
                "scrape_interval": f"{SCRAPE_INTERVAL_S}s",
                "scrape_timeout": f"{SCRAPE_INTERVAL_S}s",
                "evaluation_interval": f"{SCRAPE_INTERVAL_S}s",
            },
            "scrape_configs": [
                {"job_name": job, "static_configs": configs} for job, configs in jobs.items()
            ],
            "rule_files": [str(path) for path in rule_files],
        }

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, jobs: int) -> None:
        """Until Prometheus answers and ``jobs`` targets have been scraped up."""

        def scraped() -> bool:
            if self._proc.poll() is not None:
                pytest.fail(f"prometheus exited: {self.log_tail()}")
            try:
                up = self.query("sum(up)")
            except OSError:
                up = []
            return bool(up) and float(up[0]["value"][1]) >= jobs

        wait_until(
            scraped,
            START_TIMEOUT_S,
            f"prometheus to scrape {jobs} targets",
            step=0.2,
            error=pytest.fail.Exception,
        )

    def samples(self, selector: str, window_s: int, at: float) -> list[tuple[float, float]]:
        """The raw (timestamp, value) samples of the one series ``selector`` matches in
        the ``window_s`` seconds up to ``at`` (a range selector as an instant query)."""
        params = {"query": f"{selector}[{window_s}s]", "time": f"{at:.3f}"}
        data = self._api("query", params)
        assert data["resultType"] == "matrix", data
        (series,) = data["result"]
        return [(float(t), float(v)) for t, v in series["values"]]

    def series(self, selector: str) -> list[dict[str, str]]:
        """The label sets of the series ``selector`` matches (``/api/v1/series``)."""
        return list(self._api("series", {"match[]": selector}))

    def _api(self, path: str, params: dict[str, str]) -> Any:
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=10) as reply:
            body = json.load(reply)
        if body.get("status") != "success":
            raise AssertionError(f"prometheus refused {params}: {body}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """An instant query's result vector (``[{metric, value: [t, "v"]}, ...]``)."""
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        data = self._api("query", params)
        assert data["resultType"] == "vector", data
        return data["result"]

    def query_range(
        self, expr: str, start: float, end: float, step: float = 1.0
    ) -> list[dict[str, Any]]:
        """A range query's matrix (``[{metric, values: [[t, "v"], ...]}, ...]``)."""
        params = {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": str(step)}
        data = self._api("query_range", params)
        assert data["resultType"] == "matrix", data
        return data["result"]

    def log_tail(self) -> str:
        self._log.flush()
        return (self.root / "prometheus.log").read_text(errors="replace")[-2000:]

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(10)
        self._log.close()


@pytest.fixture
def prometheus_factory(tmp_path: Path) -> Iterator[Any]:
    started: list[Prometheus] = []

    def start(
        jobs: dict[str, str],
        namespace: str,
        pod: str,
        extra: dict[str, dict[str, str]] | None = None,
        rule_files: tuple[Path, ...] = (),
    ) -> Prometheus:
        """Prometheus scraping ``{job: "host:port"}``, each labelled with ``namespace``/``pod``
        and the job's labels in ``extra``, evaluating the rules in ``rule_files``."""
        targets = [
            Target(job, address, namespace, pod, tuple(sorted((extra or {}).get(job, {}).items())))
            for job, address in jobs.items()
        ]
        prom = Prometheus(tmp_path / f"prometheus-{len(started)}", targets, rule_files)
        started.append(prom)
        prom.wait_ready(jobs=len(targets))
        return prom

    yield start
    for prom in started:
        prom.stop()
