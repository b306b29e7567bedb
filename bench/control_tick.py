"""Reconcile-tick latency (p50/p99) and resident memory per tracked block at 100k, 1M and 5M blocks.

    python -m bench.control_tick            # 100k, 1M, 5M (each size in its own process for a clean RSS)
    python -m bench.control_tick 1000000    # one size

Each size: a real :class:`BlockIndex` filled through its public API with chains of 16 blocks (5 % resident in
gpu, 30 % in cpu, the rest on disk or nowhere), the real loop in shadow mode with the heuristic predictor,
the planner with gpu/cpu/disk tiers sized so watermarks and promotions are live, 2 000 touches between ticks,
60 ticks on an injected clock. Memory = RSS growth (index + loop state, after the ticks) / tracked blocks.
Targets (issue 4): tick p99 <= 50 ms and <= 256 bytes resident per tracked block at 1M.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_one(n: int, ticks: int = 60, seed: int = 0) -> dict[str, float]:
    from prometheus_client import CollectorRegistry

    from kvtier.controller.loop import ReconcileLoop
    from kvtier.controller.metrics import ControllerMetrics
    from kvtier.controller.policy_doc import PolicyDoc, TierConfig
    from kvtier.policies.index import BlockIndex
    from kvtier.policies.tiers import Tier

    rng = np.random.default_rng(seed)
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
            TierConfig(
                tier=Tier.GPU, capacity_blocks=int(counts[Tier.GPU] * 1.02), load_bandwidth_bytes_s=1e12
            ),
            TierConfig(
                tier=Tier.CPU, capacity_blocks=int(counts[Tier.CPU] * 1.10), load_bandwidth_bytes_s=2e10
            ),
            TierConfig(tier=Tier.DISK, capacity_blocks=n, load_bandwidth_bytes_s=2e9),
        ],
    )
    now = [3_600.0]
    reg = CollectorRegistry()
    loop = ReconcileLoop(idx, policy=doc, metrics=ControllerMetrics(reg), clock=lambda: now[0])
    durs, cpus = [], []
    decisions = 0
    for _ in range(ticks):
        for s in rng.integers(0, n, 2000).tolist():
            idx.touch(int(idx.hash[s]), now[0] * 1000)
        c0 = time.thread_time()
        rep = loop.tick()
        cpus.append(time.thread_time() - c0)
        durs.append(rep.duration_s)
        decisions += rep.decisions
        now[0] += 1.0
    d = np.array(durs[5:]) * 1000  # drop warm-up ticks
    cpu = np.array(cpus[5:]) * 1000
    mem = rss_bytes() - base
    return {
        "blocks": n,
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
    }


def main(argv: list[str]) -> None:
    if argv:
        print(json.dumps(run_one(int(argv[0]))))
        return
    rows = []
    for n in (100_000, 1_000_000, 5_000_000):
        out = subprocess.run(
            [sys.executable, "-m", "bench.control_tick", str(n)], capture_output=True, text=True, check=True
        )
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(
        f"{'blocks':>10} {'p50 ms':>8} {'p99 ms':>8} {'cpu p50':>8} {'cpu p99':>8} {'dec/tick':>9} "
        f"{'B/block':>8} {'p99/50ms':>9} {'B/256':>6} {'load':>5}"
    )
    for r in rows:
        print(
            f"{r['blocks']:>10,} {r['tick_p50_ms']:>8.1f} {r['tick_p99_ms']:>8.1f} "
            f"{r['tick_cpu_p50_ms']:>8.1f} "
            f"{r['tick_cpu_p99_ms']:>8.1f} {r['decisions_per_tick']:>9.1f} {r['bytes_per_block']:>8.0f} "
            f"{r['tick_p99_ms'] / 50:>9.2f} {r['bytes_per_block'] / 256:>6.2f} {r['loadavg_1m']:>5.1f}"
        )
    one_m = next(r for r in rows if r["blocks"] == 1_000_000)
    wall = one_m["tick_p99_ms"] <= 50
    cpu = one_m["tick_cpu_p99_ms"] <= 50
    mem = one_m["bytes_per_block"] <= 256
    print(
        f"at 1M: tick p99 wall {one_m['tick_p99_ms']:.1f} ms ({'MET' if wall else 'NOT MET'}), "
        f"tick p99 cpu {one_m['tick_cpu_p99_ms']:.1f} ms ({'MET' if cpu else 'NOT MET'}) vs 50 ms; "
        f"{one_m['bytes_per_block']:.0f} B/block ({'MET' if mem else 'NOT MET'}) vs 256; "
        f"load average {one_m['loadavg_1m']:.1f} on {os.cpu_count()} cores"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
