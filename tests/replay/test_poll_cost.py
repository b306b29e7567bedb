"""``bench.poll_cost``: switchback windows, their paired ratio, and the freeze switch on a real process."""

from __future__ import annotations

import math
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from bench.poll_cost import cpu_s, freeze_switch, pair_ratio_ci, window_pairs


def test_windows_pair_each_polling_window_with_the_quiet_one_after_it() -> None:
    """Even windows poll, odd ones are quiet; failed requests and pairs missing a half are left out."""
    sent = [0.5, 1.0, 6.5, 7.0, 12.1, 13.0, 18.2, 24.5, 3.0]
    ttft = [0.11, 0.13, 0.10, 0.10, 0.12, 0.12, 0.10, 0.3, math.nan]
    assert window_pairs(sent, ttft, 6.0) == [(0.12, 0.10), (0.12, 0.10)]  # the window from 24 s has no pair


def test_pair_ratio_interval_covers_a_known_cost_and_excludes_one() -> None:
    """Quiet windows drift by 10 % between pairs; polling windows cost 3 % more: the paired interval holds
    1.03 and excludes 1 because each pair shares its minute."""
    rng = np.random.default_rng(3)
    host = 0.1 * (1 + rng.normal(0, 0.1, 20))
    pairs = [(h * 1.03 * (1 + rng.normal(0, 0.005)), h * (1 + rng.normal(0, 0.005))) for h in host]
    r, lo, hi = pair_ratio_ci(pairs)
    assert lo <= 1.03 <= hi and lo > 1.0 and abs(r - 1.03) < 0.01, (r, lo, hi)
    r, lo, hi = pair_ratio_ci(
        [(h * (1 + rng.normal(0, 0.005)), h * (1 + rng.normal(0, 0.005))) for h in host]
    )
    assert lo <= 1.0 <= hi, (r, lo, hi)


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_freeze_switch_stops_a_real_process_in_odd_windows_and_leaves_it_running() -> None:
    """A busy child process is frozen (state T) in odd windows and runs in even ones; once the switch is
    halted it runs again, and its CPU seconds kept growing while it ran."""
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    halt = threading.Event()
    try:
        t0 = time.perf_counter()
        sw = threading.Thread(target=freeze_switch, args=(child.pid, t0, 0.3, halt), daemon=True)
        sw.start()
        seen: set[str] = set()
        deadline = time.monotonic() + 10
        while not {"T", "R"} <= seen and time.monotonic() < deadline:
            seen.add(_state(child.pid))
        assert {"T", "R"} <= seen, seen
        halt.set()
        sw.join(timeout=5)
        assert not sw.is_alive()
        c0 = cpu_s(child.pid)
        deadline = time.monotonic() + 10
        while cpu_s(child.pid) <= c0 and time.monotonic() < deadline:
            pass  # polling the child's CPU counter with a deadline
        assert _state(child.pid) != "T" and cpu_s(child.pid) > c0
    finally:
        halt.set()
        child.kill()
        child.wait()
