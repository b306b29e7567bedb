"""Soak: flood a real ``kvtier serve`` with KV events while scraping its API; RSS slope, API p99, tick p99.

Everything on 127.0.0.1: a stand-in engine endpoint (``/kv_event_sources``, ``/metrics``, ``/v1/models``; no
vLLM can flood millions of distinct blocks on this machine, so the publisher is this script: it speaks the
real vLLM 0.33 wire format over a real ZMQ PUB socket), the sidecar as a subprocess, and scrapers hitting
``/healthz``, ``/metrics`` and ``/v1/status`` at a fixed rate. Every batch stores ``--chain`` *distinct*
new blocks (never removed: the worst case for per-block memory) until ``--blocks`` have been sent or
``--duration`` seconds have passed. At the end the sidecar gets SIGTERM and the time to exit is measured.

Printed (all from this one run): blocks sent and the sidecar's events/s, RSS at start / after warm-up / at
the end and the RSS slope after warm-up (MB per million blocks and MB per minute, least squares over the
second half of the run), p50/p99/max latency per endpoint, the reconcile tick p99 (from the
``kvtier_loop_tick_seconds`` histogram), and the SIGTERM exit time.

Run: ``python -m bench.soak --blocks 5000000 --policy learned`` (``--python``/``--pythonpath`` run another
build, e.g. the tree before a change, with the same driver).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import msgspec
import zmq

TOKEN = "soak-token"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def engine_stub(zmq_port: int) -> ThreadingHTTPServer:
    """The engine's discovery endpoints (the KV events themselves come over real ZMQ)."""
    sources = json.dumps({"0": {"endpoint": f"tcp://*:{zmq_port}", "topic": "kv-events", "publisher": "zmq"}})

    class H(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server API
            if self.path == "/kv_event_sources":
                body, ctype = sources.encode(), "application/json"
            elif self.path == "/v1/models":
                body, ctype = b'{"data": [{"id": "soak", "root": "soak"}]}', "application/json"
            else:
                body, ctype = b"# no metrics\n", "text/plain"
            self.send_response(200)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", free_port()), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6
    except OSError:
        return float("nan")


def tick_p99(metrics_text: str) -> float | None:
    """p99 of ``kvtier_loop_tick_seconds`` from the cumulative histogram (the bucket's upper bound)."""
    buckets: list[tuple[float, float]] = []
    for line in metrics_text.splitlines():
        if line.startswith("kvtier_loop_tick_seconds_bucket"):
            bound = line.split('le="', 1)[1].split('"', 1)[0]
            buckets.append((float("inf") if bound == "+Inf" else float(bound), float(line.rsplit(" ", 1)[1])))
    if not buckets or buckets[-1][1] == 0:
        return None
    buckets.sort()
    total = buckets[-1][1]
    for upper, n in buckets:
        if n >= 0.99 * total:
            return upper
    return None


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=2_000_000, help="distinct blocks to store")
    ap.add_argument("--duration", type=float, default=300.0, help="stop flooding after this many seconds")
    ap.add_argument(
        "--chain", type=int, default=64, help="blocks per BlockStored event (one event per batch)"
    )
    ap.add_argument("--policy", default="learned", help="--policy of the sidecar (learned, none, ...)")
    ap.add_argument("--index-max-blocks", type=int, default=200_000, help="KVTIER_INDEX_MAX_BLOCKS")
    ap.add_argument("--rate", type=float, default=50_000, help="blocks/s published (0 = as fast as possible)")
    ap.add_argument("--rps", type=float, default=20.0, help="requests/s per scraped endpoint")
    ap.add_argument("--python", default=sys.executable, help="interpreter running kvtier")
    ap.add_argument("--pythonpath", default="", help="PYTHONPATH for that interpreter (another build)")
    args = ap.parse_args()

    zport, port = free_port(), free_port()
    stub = engine_stub(zport)
    state = tempfile.mkdtemp(prefix="kvtier-soak-")
    env = dict(os.environ, KVTIER_API_TOKEN=TOKEN, KVTIER_INDEX_MAX_BLOCKS=str(args.index_max_blocks),
               KVTIER_DISCOVERY_INTERVAL_S="1", KVTIER_STORAGE_ENABLED="false", DO_NOT_TRACK="1")  # fmt: skip
    if args.pythonpath:
        env["PYTHONPATH"] = args.pythonpath
    log = Path(state) / "serve.log"
    proc = subprocess.Popen(
        [args.python, "-m", "kvtier", "serve", "--engine-url", f"http://127.0.0.1:{stub.server_port}",
         "--listen", f"127.0.0.1:{port}", "--state-dir", state, "--policy", args.policy],
        env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 0)  # the sidecar's receive side decides what is kept
    pub.bind(f"tcp://127.0.0.1:{zport}")
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            sys.exit(f"sidecar did not come up:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    # wait until the SUB is connected (discovery done): a probe batch is counted
    enc = msgspec.msgpack.Encoder()
    rng = random.Random(0)
    seq = 0

    def batch(n: int) -> list[bytes]:
        nonlocal seq
        ev = {"type": "BlockStored", "block_hashes": [rng.getrandbits(63) for _ in range(n)],
              "parent_block_hash": None, "token_ids": [], "block_size": 16, "lora_id": None,
              "medium": "GPU"}  # fmt: skip
        f = [b"kv-events", seq.to_bytes(8, "big"), enc.encode([time.time(), [ev], 0])]
        seq += 1
        return f

    def received() -> int:
        st = httpx.get(url + "/v1/status", timeout=30).json()
        return int(sum(st["kv_events_received"] for _ in [0]))

    deadline = time.monotonic() + 30
    while received() == 0:
        pub.send_multipart(batch(1))
        if time.monotonic() > deadline:
            sys.exit("the sidecar never subscribed")
        time.sleep(0.3)

    lat: dict[str, list[float]] = {"/healthz": [], "/metrics": [], "/v1/status": []}
    errors: dict[str, int] = dict.fromkeys(lat, 0)
    stop = threading.Event()

    def scraper(path: str) -> None:
        with httpx.Client(base_url=url, timeout=120) as c:
            nxt = time.monotonic()
            while not stop.is_set():
                t0 = time.monotonic()
                try:
                    c.get(path).raise_for_status()
                except httpx.HTTPError:
                    errors[path] += 1
                lat[path].append(time.monotonic() - t0)
                nxt += 1.0 / args.rps
                time.sleep(max(0.0, nxt - time.monotonic()))

    rss: list[tuple[float, float, int]] = []  # (t s, RSS MB, blocks sent)
    sent = 0
    t_start = time.monotonic()

    def sampler() -> None:
        while not stop.is_set():
            rss.append((time.monotonic() - t_start, rss_mb(proc.pid), sent))
            time.sleep(1.0)

    threads = [threading.Thread(target=scraper, args=(p,), daemon=True) for p in lat]
    threads.append(threading.Thread(target=sampler, daemon=True))
    rss0 = rss_mb(proc.pid)
    for t in threads:
        t.start()
    while sent < args.blocks and time.monotonic() - t_start < args.duration and proc.poll() is None:
        pub.send_multipart(batch(args.chain))
        sent += args.chain
        if args.rate > 0:
            ahead = sent / args.rate - (time.monotonic() - t_start)
            if ahead > 0:
                time.sleep(ahead)  # pacing the publisher
        elif seq % 64 == 0:
            time.sleep(0)  # let the scrapers' threads in
    flood_s = time.monotonic() - t_start
    time.sleep(5)  # scrapes continue while the backlog drains
    stop.set()
    for t in threads:
        t.join(timeout=150)
    metrics = ""
    try:
        metrics = httpx.get(url + "/metrics", timeout=120).text
        st = httpx.get(url + "/v1/status", timeout=120).json()
    except httpx.HTTPError:
        st = {}
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=240)
        exit_s = time.monotonic() - t0
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        exit_s = float("inf")
    pub.close(linger=0)
    ctx.term()
    stub.shutdown()

    half = [r for r in rss if r[0] >= rss[-1][0] / 2] if rss else []
    slope_min = slope_mblk = float("nan")
    if len(half) >= 3:
        ts, ms, bs = zip(*half, strict=True)
        slope_min = statistics.linear_regression(ts, ms).slope * 60
        if bs[-1] > bs[0]:
            slope_mblk = statistics.linear_regression(bs, ms).slope * 1e6
    rcv = st.get("kv_events_received", 0)
    print(f"soak: policy={args.policy} index_max_blocks={args.index_max_blocks} chain={args.chain} "
          f"rps/endpoint={args.rps}")  # fmt: skip
    print(f"  blocks sent {sent:,} in {flood_s:.1f} s; sidecar events received {rcv:,} "
          f"({rcv * args.chain / max(flood_s, 1e-9):,.0f} blocks/s); blocks_tracked "
          f"{sum((st.get('blocks_tracked') or {}).values()):,}; index {st.get('index_blocks')}")  # fmt: skip
    print(f"  RSS MB: start {rss0:.0f}, mid {half[0][1] if half else float('nan'):.0f}, "
          f"end {rss[-1][1] if rss else float('nan'):.0f}; slope after warm-up "
          f"{slope_mblk:+.1f} MB per M blocks, {slope_min:+.1f} MB/min")  # fmt: skip
    for p, xs in lat.items():
        print(f"  {p:<11} n={len(xs):>5} p50 {pct(xs, 0.5) * 1e3:8.1f} ms  p99 {pct(xs, 0.99) * 1e3:9.1f} ms"
              f"  max {max(xs, default=float('nan')) * 1e3:9.1f} ms  errors {errors[p]}")  # fmt: skip
    tp = tick_p99(metrics)
    print(f"  tick p99 {'n/a' if tp is None else f'<= {tp * 1e3:.0f} ms'}; SIGTERM -> exit {exit_s:.2f} s "
          f"(rc {proc.returncode})")  # fmt: skip


if __name__ == "__main__":
    main()
