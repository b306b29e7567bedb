"""Reconcile-tick latency (p50/p99) and resident memory per tracked block at 100k, 1M and 5M blocks, without
and with the placement policy object (``--policy``).

    python -m bench.control_tick                    # none AND learned, 100k / 1M / 5M (one process each)
    python -m bench.control_tick --policy lru       # one policy (none | lru | learned | any registry name)
    python -m bench.control_tick 1000000 --policy learned --json   # one size, one policy, JSON line

Each size: a real :class:`BlockIndex` filled through its public API with chains of 16 blocks (5 % resident in
gpu, 30 % in cpu, the rest on disk or nowhere), the real loop in shadow mode with the heuristic predictor,
the planner with gpu/cpu/disk tiers sized so watermarks and promotions are live, 2 000 touches between ticks,
60 ticks on an injected clock. With a policy, it places the cpu tier (capacity = the cpu tier's) and 200
requests per tick are fed *between* ticks, as the ingest path does: the bundled conversation trace's
requests in order, each trace block id mapped onto an index block by a fixed random permutation (prefix
sharing kept), submitted and fed with ``PolicyPlacement.feed`` (timed separately: feed cost per request).
Tick CPU = thread CPU time of the tick (load-independent on a shared machine). Memory = RSS growth (index +
loop + policy state, after the ticks) / tracked blocks; the workload (trace, its block mapping) is loaded
before the baseline, and the imported modules' objects are frozen out of the cyclic GC first, as ``kvtier
serve`` does after startup. Targets (issue 4): tick p99 <= 50 ms and <= 256 bytes resident per tracked
block at 1M.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from typing import Any

import numpy as np


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


REQUESTS_PER_TICK = 200
TARGET_P99_MS = 50.0
TARGET_BYTES = 256.0


def run_one(n: int, policy: str = "none", ticks: int = 60, seed: int = 0) -> dict[str, Any]:
    from prometheus_client import CollectorRegistry

    from kvtier.controller.metrics import ControllerMetrics
    from kvtier.controller.policy_doc import PolicyDoc
    from kvtier.controller.root import build_loop
    from kvtier.policies.base import Request
    from kvtier.policies.index import BlockIndex
    from kvtier.policies.tiers import Tier, TierSpec
    from kvtier.replay.trace import bundled_trace_path, load_trace

    rng = np.random.default_rng(seed)
    trace: list[Request] = []
    chains: list[np.ndarray] = []
    if policy != "none":  # the workload (trace requests -> index rows) is the bench's, not the controller's
        trace = load_trace(bundled_trace_path())
        ids = np.concatenate([r.hash_ids for r in trace])
        lo_id = int(ids.min())
        # trace block id - lo_id (mod n: the 100k index aliases a few) -> row, a fixed random permutation
        perm = np.random.default_rng(seed + 1).permutation(n)
        chains = [perm[(r.hash_ids - lo_id) % n] for r in trace]
        del ids, perm
    gc.freeze()  # as ``kvtier serve`` does after startup: imported modules' objects out of the cyclic GC
    base = rss_bytes()
    idx = BlockIndex(initial_capacity=n)
    chain = 16
    t0 = time.perf_counter()
    step = 65_536  # generate in chunks so the bench's own temporaries stay small
    for lo in range(0, n, step):
        m = min(step, n - lo)
        hl = rng.integers(1, 2**62, size=m, dtype=np.int64).tolist()
        u = rng.random(m)
        tl = np.where(u < 0.05, 0, np.where(u < 0.35, 1, np.where(u < 0.8, 2, -1))).tolist()
        tml = rng.uniform(0, 3_600_000, size=m).tolist()
        for i in range(m):
            parent = hl[i - 1] if (lo + i) % chain and i else None
            r = tl[i]
            idx.store(hl[i], parent, r if r >= 0 else 3, 65536, tml[i])
            if r < 0:
                idx.remove(hl[i])
        del hl, tl, tml, u
    build_s = time.perf_counter() - t0
    counts = idx.count_by_tier()
    doc = PolicyDoc(
        mode="shadow",
        tiers=[
            TierSpec(
                tier=Tier.GPU, capacity_blocks=int(counts[Tier.GPU] * 1.02), load_bandwidth_bytes_s=1e12
            ),
            TierSpec(
                tier=Tier.CPU, capacity_blocks=int(counts[Tier.CPU] * 1.10), load_bandwidth_bytes_s=2e10
            ),
            TierSpec(tier=Tier.DISK, capacity_blocks=n, load_bandwidth_bytes_s=2e9),
        ],
    )
    now = [3_600.0]
    reg = CollectorRegistry()
    placement = None if policy == "none" else policy
    loop = build_loop(idx, policy=doc, metrics=ControllerMetrics(reg), clock=lambda: now[0],
                      placement_policy=placement, placement_tier=Tier.CPU)  # fmt: skip
    durs, cpus = [], []
    feed_cpu = 0.0
    fed = 0
    decisions = 0
    for k in range(ticks):
        for s in rng.integers(0, n, 2000).tolist():
            idx.touch(int(idx.hash[s]), now[0] * 1000)
        pl = loop.placement
        if pl is not None:  # the request stream between ticks, fed as it arrives (the ingest path)
            for i in range(REQUESTS_PER_TICK):
                j = (k * REQUESTS_PER_TICK + i) % len(trace)
                r = trace[j]
                t_ms = now[0] * 1000 - 1000 + (i + 1) * (1000 / REQUESTS_PER_TICK)
                chain = idx.hash[chains[j]]
                pl.requests.submit(Request(t_ms, r.input_length, r.output_length, chain, block_tokens=16))
                c0 = time.thread_time()
                fed += pl.feed(None)
                feed_cpu += time.thread_time() - c0
        c0 = time.thread_time()
        rep = loop.tick()
        cpus.append(time.thread_time() - c0)
        durs.append(rep.duration_s)
        decisions += rep.decisions
        now[0] += 1.0
    d = np.array(durs[5:]) * 1000  # drop warm-up ticks
    cpu = np.array(cpus[5:]) * 1000
    mem = rss_bytes() - base
    info = loop.placement.info() if loop.placement is not None else {}
    return {
        "policy": policy,
        "blocks": n,
        "requests_fed": fed,
        "feed_us_per_request": 1e6 * feed_cpu / fed if fed else 0.0,
        "policy_resident_blocks": info.get("resident_blocks", 0),
        "policy_block_hit_rate": info["block_hits"] / max(1, info["block_accesses"]) if info else 0.0,
        "build_s": build_s,
        "ticks": len(d),
        "tick_p50_ms": float(np.percentile(d, 50)),
        "tick_p99_ms": float(np.percentile(d, 99)),
        "tick_max_ms": float(d.max()),
        "tick_cpu_p50_ms": float(np.percentile(cpu, 50)),
        "tick_cpu_p99_ms": float(np.percentile(cpu, 99)),
        "loadavg_1m": os.getloadavg()[0],
        "decisions_per_tick": decisions / ticks,
        "rss_growth_bytes": mem,
        "bytes_per_block": mem / n,
        "index_estimate_bytes_per_block": idx.nbytes_per_block(),
        "phase_mean_ms": {
            ph: 1000 * (reg.get_sample_value("kvtier_loop_phase_seconds_sum", {"phase": ph}) or 0) / ticks
            for ph in ("observe", "predict", "plan", "act", "score")
        },
        "policy_fallbacks": sum(1 for e in loop.errors if e.startswith(("policy", "predict"))),
    }


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def main(argv: list[str]) -> None:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m bench.control_tick", description=__doc__.split("\n")[0])
    ap.add_argument("sizes", nargs="*", type=int, help="block counts (default 100k 1M 5M)")
    ap.add_argument("--policy", action="append", help="none|lru|learned (repeatable; default none + learned)")
    ap.add_argument("--ticks", type=int, default=60)
    ap.add_argument("--json", action="store_true", help="run in this process, print one JSON line per run")
    a = ap.parse_args(argv)
    policies = a.policy or ["none", "learned"]
    sizes = a.sizes or [100_000, 1_000_000, 5_000_000]
    if a.json:
        for pol in policies:
            for n in sizes:
                print(json.dumps(run_one(n, pol, a.ticks)), flush=True)
        return
    rows = []
    for pol in policies:
        for n in sizes:  # one process per run: a clean RSS baseline
            cmd = [sys.executable, "-m", "bench.control_tick", str(n), "--policy", pol]
            cmd += ["--ticks", str(a.ticks), "--json"]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True)
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"  done: {pol} {n:,}", file=sys.stderr, flush=True)
    print(
        f"{'policy':>8} {'blocks':>10} {'wall p50':>9} {'wall p99':>9} {'cpu p50':>8} {'cpu p99':>8} "
        f"{'feed us/req':>11} {'dec/tick':>9} {'B/block':>8} {'load':>5}"
    )
    for r in rows:
        print(
            f"{r['policy']:>8} {r['blocks']:>10,} {r['tick_p50_ms']:>9.1f} {r['tick_p99_ms']:>9.1f} "
            f"{r['tick_cpu_p50_ms']:>8.1f} {r['tick_cpu_p99_ms']:>8.1f} {r['feed_us_per_request']:>11.0f} "
            f"{r['decisions_per_tick']:>9.1f} {r['bytes_per_block']:>8.0f} {r['loadavg_1m']:>5.1f}"
        )
    for r in rows:
        if r["blocks"] != 1_000_000:
            continue
        wall = r["tick_p99_ms"] <= TARGET_P99_MS
        cpu = r["tick_cpu_p99_ms"] <= TARGET_P99_MS
        mem = r["bytes_per_block"] <= TARGET_BYTES
        print(
            f"{r['policy']} at 1M: tick p99 wall {r['tick_p99_ms']:.1f} ms {_verdict(wall)}, "
            f"tick p99 cpu {r['tick_cpu_p99_ms']:.1f} ms {_verdict(cpu)} (target {TARGET_P99_MS:.0f} ms); "
            f"{r['bytes_per_block']:.0f} B/block {_verdict(mem)} (target {TARGET_BYTES:.0f}); "
            f"feed {r['feed_us_per_request']:.0f} us/request off the tick; "
            f"load average {r['loadavg_1m']:.1f} on {os.cpu_count()} cores"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
