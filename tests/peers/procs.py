"""Helpers for tests that start real peer processes: free ports, polling with a deadline, clean stop."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

PEER_ENV = {
    "DO_NOT_TRACK": "1",
    "LMCACHE_TRACK_USAGE": "false",
    "VLLM_NO_USAGE_STATS": "1",
    "LMCACHE_DISABLE_BANNER": "1",
    "PYTHONWARNINGS": "ignore",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}


def require_env(name: str) -> str:
    """The peer path from ``/work/peers/env.sh`` / ``.peers/env.sh``; fail (not skip) when missing."""
    v = os.environ.get(name)
    if not v or not Path(v.split(":")[0]).exists():
        raise RuntimeError(
            f"{name} is not set or does not exist ({v!r}); run scripts/setup-peers.sh and source its env.sh"
        )
    return v


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(
    cond: Callable[[], T | None],
    timeout_s: float,
    what: str,
    interval_s: float = 0.2,
    proc: subprocess.Popen[bytes] | None = None,
    log: Path | None = None,
) -> T:
    """Poll ``cond`` until it returns a truthy value or the deadline passes (then raise with the log tail)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            v = cond()
        except Exception:  # noqa: BLE001 - not ready yet
            v = None
        if v:
            return v
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what}: process exited with {proc.returncode}\n{tail(log)}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not ready after {timeout_s} s\n{tail(log)}")
        time.sleep(interval_s)


def tail(log: Path | None, n: int = 40) -> str:
    if log is None or not log.exists():
        return ""
    return "\n".join(log.read_text(errors="replace").splitlines()[-n:])


def start(
    cmd: list[str],
    log: Path,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    new_session: bool = True,
) -> subprocess.Popen[bytes]:
    """Start ``cmd`` with output to ``log``; ``new_session`` puts it in its own process group."""
    full_env = dict(os.environ)
    full_env.update(PEER_ENV)
    if env:
        full_env.update(env)
    fh = open(log, "ab")  # noqa: SIM115 - handed to the child
    return subprocess.Popen(
        cmd, stdout=fh, stderr=subprocess.STDOUT, env=full_env, cwd=cwd, start_new_session=new_session
    )


def stop(proc: subprocess.Popen[bytes] | None, timeout_s: float = 15.0) -> None:
    """SIGTERM the process (group, when it leads one), then SIGKILL after ``timeout_s``."""
    if proc is None or proc.poll() is not None:
        return
    try:
        leader = os.getpgid(proc.pid) == proc.pid
    except ProcessLookupError:
        return
    kill = (lambda sig: os.killpg(proc.pid, sig)) if leader else (lambda sig: os.kill(proc.pid, sig))
    try:
        kill(signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            kill(signal.SIGKILL)
        proc.wait(timeout=10)
