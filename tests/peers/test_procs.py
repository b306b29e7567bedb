"""The peers' start-up wait: patient while a peer makes progress, a clear error when it stalls or dies."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.peers.procs import start, stop, wait_started

# logs a line every 0.2 s for 2 s, sleeping (no CPU) in between, then writes the ready file and idles
CHATTY = """
import sys, time
for i in range(10):
    print(f"loading shard {i}", flush=True)
    time.sleep(0.2)
open(sys.argv[1], "w").close()
time.sleep(60)
"""
# says one thing, then sleeps without a word or CPU: a stall
SILENT = 'import time; print("waiting for the engine core", flush=True); time.sleep(60)'


def test_a_peer_that_keeps_logging_outlasts_the_stall_window(tmp_path: Path) -> None:
    ready, log = tmp_path / "ready", tmp_path / "peer.log"
    proc = start([sys.executable, "-c", CHATTY, str(ready)], log)
    try:
        # the stall window (1 s) is shorter than the start (2 s): progress keeps extending it
        assert wait_started(ready.exists, "chatty peer", proc=proc, log=log, stall_s=1.0, interval_s=0.05)
    finally:
        stop(proc)


def test_a_stalled_peer_fails_naming_itself_and_its_last_log_line(tmp_path: Path) -> None:
    log = tmp_path / "peer.log"
    proc = start([sys.executable, "-c", SILENT], log)
    try:
        with pytest.raises(TimeoutError, match=r"silent peer \(pid \d+\) stalled: no progress for 1 s; "
                           r"last log line: waiting for the engine core"):  # fmt: skip
            wait_started(lambda: False, "silent peer", proc=proc, log=log, stall_s=1.0, interval_s=0.05)
    finally:
        stop(proc)


def test_a_peer_that_exits_fails_at_once_with_its_exit_code(tmp_path: Path) -> None:
    log = tmp_path / "peer.log"
    proc = start([sys.executable, "-c", 'print("bad flag --nope"); raise SystemExit(2)'], log)
    with pytest.raises(RuntimeError, match=r"exited with 2 .*last log line: bad flag --nope"):
        wait_started(lambda: False, "broken peer", proc=proc, log=log, stall_s=60.0, interval_s=0.05)


def test_the_cap_bounds_a_peer_that_is_busy_but_never_ready(tmp_path: Path) -> None:
    log = tmp_path / "peer.log"
    proc = start([sys.executable, "-c", CHATTY, str(tmp_path / "ready")], log)
    try:
        with pytest.raises(TimeoutError, match=r"not ready after 1 s"):
            wait_started(
                lambda: False, "busy peer", proc=proc, log=log, stall_s=30.0, cap_s=0.6, interval_s=0.05
            )
    finally:
        stop(proc)
