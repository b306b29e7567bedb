"""Start a REAL Prometheus (Debian's ``prometheus``) on a free 127.0.0.1 port scraping given targets; talk
to its HTTP API. ``promtool`` helpers for rule checks live here too.

    with running({"vllm": ["127.0.0.1:8000"]}, rule_files=[...]) as prom:
        prom.wait_scraped({"vllm"})
        prom.query("up")
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.peers.procs import free_port, start, stop, tail, wait_for, wait_started


class PrometheusMissing(RuntimeError):
    """Debian's prometheus / promtool is not installed."""


def binary(name: str) -> str:
    """Path of ``prometheus`` or ``promtool``; raises :class:`PrometheusMissing` (tests then FAIL)."""
    path = shutil.which(name)
    if not path:
        raise PrometheusMissing(
            f"{name} not on PATH: run scripts/setup-peers.sh (apt-get install prometheus)"
        )
    return path


def config_yaml(
    jobs: dict[str, Sequence[str]], rule_files: Sequence[Path] = (), interval_s: float = 1.0
) -> str:
    """A prometheus.yml scraping each job's ``host:port`` targets every ``interval_s`` seconds."""
    lines = [
        "global:",
        f"  scrape_interval: {int(interval_s * 1000)}ms",
        f"  evaluation_interval: {int(interval_s * 1000)}ms",
        f"  scrape_timeout: {int(interval_s * 1000)}ms",
    ]
    if rule_files:
        lines.append("rule_files:")
        lines += [f"  - {Path(p).resolve()}" for p in rule_files]
    lines.append("scrape_configs:")
    for job, targets in jobs.items():
        lines += [f"  - job_name: {job}", "    static_configs:", "      - targets:"]
        lines += [f"          - {t}" for t in targets]
    return "\n".join(lines) + "\n"


@dataclass
class Prometheus:
    """A running Prometheus process; :attr:`url` is its HTTP API."""

    workdir: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    jobs: dict[str, list[str]] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return self.workdir / "prometheus.log"

    def start(
        self,
        jobs: dict[str, Sequence[str]],
        rule_files: Sequence[Path] = (),
        interval_s: float = 1.0,
        timeout_s: float = 60.0,
    ) -> Prometheus:
        self.jobs = {k: list(v) for k, v in jobs.items()}
        cfg = self.workdir / "prometheus.yml"
        cfg.write_text(config_yaml(jobs, rule_files, interval_s))
        cmd = [
            binary("prometheus"),
            f"--config.file={cfg}",
            f"--storage.tsdb.path={self.workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--log.level=warn",
        ]
        self.proc = start(cmd, self.log, cwd=self.workdir)
        wait_started(
            lambda: httpx.get(self.url + "/-/ready", timeout=2).status_code == 200,
            "prometheus",
            proc=self.proc,
            log=self.log,
            stall_s=timeout_s,
        )
        return self

    def stop(self) -> None:
        stop(self.proc)
        self.proc = None

    def log_tail(self) -> str:
        return tail(self.log)

    # -- HTTP API --------------------------------------------------------------------------------------------
    def api(self, path: str, **params: Any) -> Any:
        """GET ``/api/v1/<path>``; returns ``data``; raises :class:`PromQLError` with Prometheus' message."""
        r = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=30)
        body = r.json()
        if body.get("status") != "success":
            raise PromQLError(f"{body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """Instant query; returns the result vector (a scalar/string result becomes a one-element list)."""
        params: dict[str, Any] = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        data = self.api("query", **params)
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        return list(data["result"])

    def series(self, match: str) -> list[dict[str, str]]:
        return list(self.api("series", **{"match[]": match}))

    def targets(self) -> list[dict[str, Any]]:
        return list(self.api("targets")["activeTargets"])

    def rules(self) -> list[dict[str, Any]]:
        return [r for g in self.api("rules")["groups"] for r in g["rules"]]

    def wait_scraped(
        self, jobs: set[str], samples: int = 2, timeout_s: float = 60.0, window: str = "5m"
    ) -> None:
        """Poll until every job's targets are up and have at least ``samples`` successful scrapes stored
        within the last ``window`` (a PromQL duration).

        Counts ``up == 1`` samples (a timed-out scrape stores ``up 0`` and no series), so rate() over the
        window has real points even on a loaded machine. Pass the window the queries use: successful
        scrapes spread over 5 m do not put two points into a ``[1m]`` rate.
        """

        def ok() -> bool:
            for job in jobs:
                res = self.query(f'sum_over_time(up{{job="{job}"}}[{window}])')
                ups = self.query(f'up{{job="{job}"}} == 1')
                if len(ups) < len(self.jobs[job]) or any(float(r["value"][1]) < samples for r in res):
                    return False
            return True

        wait_for(
            ok,
            timeout_s,
            f"prometheus scraping {sorted(jobs)} ({self.targets_summary()})",
            interval_s=0.5,
            proc=self.proc,
            log=self.log,
        )

    def wait_until(self, expr: str, pred: Callable[[float], bool], timeout_s: float = 60.0) -> float:
        """Poll an instant query until its first value satisfies ``pred``; returns that value."""

        def ok() -> float | None:
            res = self.query(expr)
            if res and pred(float(res[0]["value"][1])):
                return float(res[0]["value"][1]) or 1e-300
            return None

        return float(
            wait_for(ok, timeout_s, f"prometheus: {expr}", interval_s=0.5, proc=self.proc, log=self.log)
        )

    def targets_summary(self) -> str:
        try:
            return ", ".join(
                f"{t['labels'].get('job')}={t['health']} {t.get('lastError', '')}".strip()
                for t in self.targets()
            )
        except Exception as e:  # noqa: BLE001 - only for an error message
            return f"targets unavailable: {e}"


class PromQLError(RuntimeError):
    """Prometheus rejected a query (parse or execution error)."""


@contextlib.contextmanager
def running(
    jobs: dict[str, Sequence[str]], rule_files: Sequence[Path] = (), interval_s: float = 1.0
) -> Iterator[Prometheus]:
    """Start Prometheus in a temp dir; always stop it and delete the TSDB on exit."""
    wd = Path(tempfile.mkdtemp(prefix="kvtier-prom-"))
    prom = Prometheus(wd)
    try:
        prom.start(jobs, rule_files, interval_s)
        yield prom
    finally:
        prom.stop()
        shutil.rmtree(wd, ignore_errors=True)


def promtool(
    *args: str | Path, cwd: Path | None = None, timeout_s: float = 120.0
) -> subprocess.CompletedProcess[str]:
    """Run ``promtool`` and capture its output (text)."""
    return subprocess.run(
        [binary("promtool"), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
        cwd=cwd,
    )
