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


# A starting peer fails only when it stops making progress: ``stall_s`` seconds in which its log did not grow
# and its processes used no CPU. The hard cap bounds a peer that keeps busy but never gets ready. Both are
# generous: on a loaded 2-core host vLLM's start takes many minutes, all of them with progress.
START_CAP_S = float(os.environ.get("KVTIER_TEST_START_CAP_S", "1800"))


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of ``pid`` and its waited-for children, from /proc; 0 when unreadable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def _group_cpu_s(pid: int) -> float:
    """CPU seconds of every process in ``pid``'s process group (vLLM's engine core is a child), or of
    ``pid`` alone when it does not lead a group."""
    try:
        pgid = os.getpgid(pid)
    except ProcessLookupError:
        return 0.0
    if pgid != pid:
        return _cpu_s(pid)
    total = 0.0
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if os.getpgid(int(d.name)) == pgid:
                    total += _cpu_s(int(d.name))
            except (ProcessLookupError, PermissionError):
                continue
    return total


def last_line(log: Path | None) -> str:
    """The last non-empty line of ``log`` (what the peer said last), or a note that it said nothing."""
    lines = [ln for ln in tail(log, 20).splitlines() if ln.strip()]
    return lines[-1].strip() if lines else "(log empty)"


def wait_started(
    cond: Callable[[], T | None],
    what: str,
    *,
    proc: subprocess.Popen[bytes],
    log: Path,
    stall_s: float,
    cap_s: float | None = None,
    interval_s: float = 0.5,
) -> T:
    """Poll ``cond`` until truthy while ``proc`` starts. Raises, naming ``what`` and its last log line, when
    the process exits, when it made no progress (no log growth, no CPU time) for ``stall_s`` seconds, or
    after ``cap_s`` (default :data:`START_CAP_S`) in all."""
    cap = START_CAP_S if cap_s is None else cap_s
    t0 = time.monotonic()
    size, cpu, moved = -1, -1.0, t0
    while True:
        try:
            v = cond()
        except Exception:  # noqa: BLE001 - not ready yet
            v = None
        if v:
            return v
        now = time.monotonic()
        if proc.poll() is not None:
            raise RuntimeError(
                f"{what} (pid {proc.pid}) exited with {proc.returncode} after {now - t0:.0f} s; "
                f"last log line: {last_line(log)}\nlog {log}:\n{tail(log)}"
            )
        new_size = log.stat().st_size if log.exists() else 0
        new_cpu = _group_cpu_s(proc.pid)
        if new_size != size or new_cpu > cpu + 0.05:
            size, cpu, moved = new_size, new_cpu, now
        if now - moved > stall_s or now - t0 > cap:
            why = (
                f"no progress for {now - moved:.0f} s"
                if now - moved > stall_s
                else f"not ready after {cap:.0f} s"
            )
            raise TimeoutError(
                f"{what} (pid {proc.pid}) stalled: {why}; last log line: {last_line(log)}\n"
                f"log {log}:\n{tail(log)}"
            )
        time.sleep(interval_s)  # polling interval of a condition with a deadline


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
