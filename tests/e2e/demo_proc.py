"""``kvtier demo`` as a real subprocess on a free port (for the e2e tests)."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.peers.procs import free_port, start, stop, wait_started


@dataclass
class DemoProc:
    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.url + path, timeout=10)


@contextlib.contextmanager
def running_demo(
    *args: str, timeout_s: float = 120.0, env: dict[str, str] | None = None
) -> Iterator[DemoProc]:
    """Start ``python -m kvtier demo --listen 127.0.0.1:PORT ARGS`` (``env`` added to the environment); wait
    for ``/healthz``; stop on exit."""
    port = free_port()
    wd = Path(tempfile.mkdtemp(prefix="kvtier-demo-e2e-"))
    log = wd / "demo.log"
    cmd = [
        sys.executable,
        "-m",
        "kvtier",
        "demo",
        "--listen",
        f"127.0.0.1:{port}",
        "--state-dir",
        str(wd),
        *args,
    ]
    proc: subprocess.Popen[bytes] = start(cmd, log, env=env)
    try:
        wait_started(
            lambda: httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200,
            "kvtier demo",
            proc=proc,
            log=log,
            stall_s=timeout_s,
        )
        yield DemoProc(proc, port, log)
    finally:
        stop(proc)
        shutil.rmtree(wd, ignore_errors=True)
