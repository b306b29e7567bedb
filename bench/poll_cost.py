"""What do the sidecar's polls -- or the whole sidecar -- cost the engine's TTFT? A switchback inside one run.

The shadow sidecar costs TTFT on a 2-core host (docs/perf/live_ab_lmcache_l1.md), and comparing arms across
runs cannot attribute a cost of 1-3 % against the host's ±20 % drift. This bench starts one fresh stack
(LMCache MP + vLLM CPU, as ``bench.live_ab`` does), sends same-sized requests one at a time (fresh tokens
each, so every one is a full prefill and an LMCache store: constant work, low spread), and in alternate
windows of ``--window-s`` seconds polls what the sidecar polls at its default cadence -- vLLM's
``/metrics``, LMCache's ``/metrics`` and ``/status`` every ``--interval-s`` -- from this process. Requests
are labelled by the window they were sent in; the ratio of mean TTFT in polling windows to that in quiet
windows, over adjacent pairs of windows, is what polling alone costs (a t interval over the pairs: adjacent
windows share the host's minute). It also prints each endpoint's response time.

With ``--sidecar MODE`` no poller runs: a real ``kvtier serve --mode MODE --actuator lmcache-l1`` (as
``bench.live_ab`` starts it) watches the stack, and is frozen (SIGSTOP) in the odd windows and thawed
(SIGCONT) in the even ones. Its whole presence -- KV-event ingest, polls, the keeper, the status page -- is
then what the even windows pay. The work of a frozen window is not lost: the KV events it missed wait in
the sockets and are ingested when it thaws, so the even windows carry about twice the sidecar's average
work and the ratio measures up to twice its average cost (an upper bound on the cost of its presence).

    python -m bench.poll_cost --model /work/ab/model-512x8 --requests 1500                    # ~4 min
    python -m bench.poll_cost --model /work/ab/model-512x8 --requests 1500 --sidecar shadow   # ~4 min
"""

from __future__ import annotations

import argparse
import asyncio
import math
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from scipy import stats as sps

from bench.live_ab import ManagedStack, keeper_sidecar_args, kv_bytes_per_chunk
from kvtier.replay.live_bench import BenchRequest, SidecarProcess, free_port, send_all


def window_pairs(
    sent_s: Sequence[float], ttft_s: Sequence[float], window_s: float
) -> list[tuple[float, float]]:
    """(mean TTFT of a polling window, mean TTFT of the quiet window after it) for every complete pair.

    Window ``k`` covers sends in ``[k * window_s, (k + 1) * window_s)``; even windows poll, odd ones do not.
    Failed requests (NaN TTFT) are left out; a pair with an empty window is dropped."""
    by_window: dict[int, list[float]] = {}
    for s, t in zip(sent_s, ttft_s, strict=True):
        if math.isfinite(s) and math.isfinite(t):
            by_window.setdefault(int(s // window_s), []).append(t)
    pairs = []
    for k in sorted(w for w in by_window if w % 2 == 0):
        on, off = by_window.get(k), by_window.get(k + 1)
        if on and off:
            pairs.append((float(np.mean(on)), float(np.mean(off))))
    return pairs


def pair_ratio_ci(pairs: Sequence[tuple[float, float]], alpha: float = 0.05) -> tuple[float, float, float]:
    """(ratio, lo, hi): the geometric mean of the pairs' on/off ratios and its Student t interval."""
    logs = np.log([on / off for on, off in pairs])
    m = float(np.mean(logs))
    if logs.size < 2:
        return (math.exp(m), math.nan, math.nan)
    half = float(sps.t.ppf(1 - alpha / 2, logs.size - 1)) * float(np.std(logs, ddof=1)) / math.sqrt(logs.size)
    return (math.exp(m), math.exp(m - half), math.exp(m + half))


def poll(urls: Sequence[str], t0: float, window_s: float, interval_s: float, stop: Any, out: Any) -> None:
    """Poll ``urls`` every ``interval_s`` during even windows of ``window_s`` after ``t0`` (perf_counter)
    until ``stop`` is set; put ``{url: [response s, ...]}`` on ``out``. Runs in a process of its own, so
    that it shares no interpreter lock with the client timing the first tokens."""
    latency: dict[str, list[float]] = {u: [] for u in urls}
    with httpx.Client(timeout=10.0) as c:
        nxt = t0
        while not stop.is_set():
            now = time.perf_counter()
            if now < nxt:
                stop.wait(nxt - now)  # pacing to the poll cadence, not synchronisation
                continue
            if int((now - t0) // window_s) % 2 == 0:
                for u in urls:
                    a = time.perf_counter()
                    try:
                        c.get(u).raise_for_status()
                    except httpx.HTTPError:
                        continue
                    latency[u].append(time.perf_counter() - a)
            nxt += interval_s
    out.put(latency)


def freeze_switch(pid: int, t0: float, window_s: float, stop: threading.Event) -> None:
    """Keep process ``pid`` running in even windows of ``window_s`` after ``t0`` (perf_counter) and frozen
    (SIGSTOP) in odd ones until ``stop`` is set; it is left running."""
    try:
        while not stop.is_set():
            now = time.perf_counter()
            k = int((now - t0) // window_s) if now >= t0 else 0
            os.kill(pid, signal.SIGSTOP if k % 2 else signal.SIGCONT)
            stop.wait(max(0.0, t0 + (k + 1) * window_s - time.perf_counter()))  # to the next window's start
    finally:
        os.kill(pid, signal.SIGCONT)


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used (``/proc/<pid>/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def requests(n: int, prompt_tokens: int, vocab: int, seed: int = 0) -> list[BenchRequest]:
    rng = np.random.default_rng(seed)
    return [BenchRequest(0.0, rng.integers(1, vocab, prompt_tokens).tolist(), 2) for _ in range(n)]


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="local model directory")
    ap.add_argument("--requests", type=int, default=1500)
    ap.add_argument("--prompt-tokens", type=int, default=448)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--l1-chunks", type=int, default=458)
    ap.add_argument("--window-s", type=float, default=6.0)
    ap.add_argument("--interval-s", type=float, default=2.0, help="the sidecar's default scrape cadence")
    ap.add_argument(
        "--sidecar", choices=("shadow", "active"), help="switch a real sidecar in this mode instead of polls"
    )
    a = ap.parse_args(argv)
    l1_gb = round(a.l1_chunks * kv_bytes_per_chunk(a.model) / 2**30, 4)
    with tempfile.TemporaryDirectory(prefix="poll-cost-") as tmp:
        stack = ManagedStack(Path(tmp), l1_gb, 96, a.model)
        tgt = stack.up("poll", 0)
        try:
            reqs = requests(a.requests, a.prompt_tokens, a.vocab)
            asyncio.run(send_all(tgt.engine_url, tgt.model, reqs[:20], concurrency=1))  # warm-up
            urls = [f"{tgt.engine_url}/metrics", f"{tgt.lmcache_url}/metrics", f"{tgt.lmcache_url}/status"]
            times: list[tuple[float, float]] = []
            start: list[float] = []
            latency: dict[str, list[float]] = {}
            side_cpu = math.nan

            def serve_from(t0: float) -> None:
                while time.perf_counter() < t0:
                    time.sleep(0.01)  # start of the first window, not synchronisation
                asyncio.run(
                    send_all(tgt.engine_url, tgt.model, reqs[20:], concurrency=1, times=times, start=start)
                )

            if a.sidecar:
                side = SidecarProcess(
                    keeper_sidecar_args(tgt, Path(tmp) / "state"),
                    a.sidecar,
                    free_port(),
                    Path(tmp) / "sidecar.log",
                    exe=[sys.executable, "-m", "kvtier"],
                ).start()
                assert side.proc is not None
                pid, t0 = side.proc.pid, time.perf_counter() + 3.0
                halt = threading.Event()
                switch = threading.Thread(target=freeze_switch, args=(pid, t0, a.window_s, halt), daemon=True)
                switch.start()
                cpu0 = cpu_s(pid)
                try:
                    serve_from(t0)
                finally:
                    halt.set()
                    switch.join(timeout=30)
                    side_cpu = cpu_s(pid) - cpu0
                    side.stop()
            else:
                ctx = mp.get_context("spawn")
                stop, out = ctx.Event(), ctx.Queue()
                t0 = time.perf_counter() + 3.0  # the poller's process starts meanwhile
                poller = ctx.Process(target=poll, args=(urls, t0, a.window_s, a.interval_s, stop, out))
                poller.start()
                serve_from(t0)
                stop.set()
                latency = out.get(timeout=60)
                poller.join(timeout=30)
        finally:
            stack.down("poll", 0)
    shift = start[0] - t0  # send times are relative to send_all's start; windows to the poller's
    sent = [s + shift for s, _ in times]
    ttft = [f - s for s, f in times]
    pairs = window_pairs(sent, ttft, a.window_s)
    r, lo, hi = pair_ratio_ci(pairs)
    what = (
        f"a {a.sidecar} sidecar thawed in alternate windows ({side_cpu:.1f} CPU s)"
        if a.sidecar
        else f"polls every {a.interval_s} s in alternate windows"
    )
    print(f"{len(ttft)} requests of {a.prompt_tokens} fresh tokens, windows of {a.window_s} s, {what}")
    for u, lat in latency.items():
        if lat:
            print(f"  {u}: {len(lat)} polls, response {1000 * np.median(lat):.1f} ms median, "
                  f"{1000 * np.max(lat):.1f} ms max")  # fmt: skip
    on = np.mean([p[0] for p in pairs]) if pairs else math.nan
    off = np.mean([p[1] for p in pairs]) if pairs else math.nan
    print(f"TTFT mean while {'running' if a.sidecar else 'polling'} {on:.4f} s, quiet {off:.4f} s; "
          f"ratio over {len(pairs)} pairs {r:.4f} [{lo:.4f}, {hi:.4f}] (95 % t)")  # fmt: skip


if __name__ == "__main__":
    main()
