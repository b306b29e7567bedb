"""Replay throughput per policy (block accesses/s) and each policy's wall time relative to LRU, one run.

    python -m bench.replay_throughput [--trace bundled] [--capacities 0.01,0.05] [--policies ...] [--cli]
        [--pairs 3]

Rates use process CPU time (robust on a shared machine; wall time is printed too). Every registered
policy is timed on the same trace and capacities (``learned`` is included when
``kvtier.policies.learned`` imports). ``--cli`` also times the whole ``kvtier replay`` command (process
start, trace load, replay) for lru and learned, alternating, ``--pairs`` times: the issue's "learned <= 10x
lru wall time" check (median of the pairs; each pair and the CPU ratio are printed too).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from collections import OrderedDict
from pathlib import Path

from kvtier.policies.registry import get_policy, is_available, known_policies
from kvtier.replay.engine import replay
from kvtier.replay.runner import capacity_for, load_workload


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default="bundled")
    ap.add_argument("--capacities", default="0.01,0.05")
    ap.add_argument("--policies", default=",".join(p for p in known_policies()))
    ap.add_argument("--max-requests", type=int, default=None)
    ap.add_argument("--cli", action="store_true", help="also time whole `kvtier replay` commands")
    ap.add_argument("--pairs", type=int, default=3, help="alternating lru/learned command pairs (--cli)")
    a = ap.parse_args(argv)
    wl = load_workload(a.trace, max_requests=a.max_requests)
    accesses = sum(len(r.hash_ids) for r in wl.requests)
    names = [p for p in a.policies.split(",") if p]
    missing = [p for p in names if not is_available(p)]
    names = [p for p in names if p not in missing]
    fracs = [float(x) for x in a.capacities.split(",")]
    print(f"trace {wl.path.name}: {len(wl.requests)} requests, {accesses} block accesses")
    if missing:
        print(f"not registered here (skipped): {', '.join(missing)}")
    # machine-speed yardstick: a bare OrderedDict LRU over the flat access list (what a minimal pure-Python
    # simulator does; the reference simulator's ~4 M acc/s LRU was such a loop on an idle core)
    flat = [b for r in wl.requests for b in r.hash_ids.tolist()]
    cap0 = capacity_for(fracs[0], None, wl.distinct_blocks) or 1
    od: OrderedDict[int, None] = OrderedDict()
    t0 = time.process_time()
    for b in flat:
        if b in od:
            od.move_to_end(b)
        else:
            if len(od) >= cap0:
                od.popitem(last=False)
            od[b] = None
    bare = accesses / (time.process_time() - t0)
    print(f"bare-loop LRU yardstick at {100 * fracs[0]:g}%: {bare / 1e6:.3f} M acc/s")
    wall: dict[str, float] = {}
    rows = []
    for p in names:
        total = 0.0
        for f in fracs:
            cap = capacity_for(f, None, wl.distinct_blocks)
            assert cap is not None
            pol = get_policy(p, cap, 0)
            t0, c0 = time.perf_counter(), time.process_time()
            s = replay(wl.requests, pol)
            dt, cpu = time.perf_counter() - t0, time.process_time() - c0
            total += cpu
            rows.append((p, f, accesses / cpu, dt, s.prefix_hit_ratio))
        wall[p] = total
    cols = ("policy", "capacity", "M acc/s", "/ bare loop", "wall s", "prefix hit %")
    print(
        "\n"
        + " ".join(
            f"{c:<10}" if i == 0 else f"{c:>{w}}"
            for i, (c, w) in enumerate(zip(cols, (10, 8, 9, 11, 7, 13), strict=True))
        )
    )
    for p, f, rate, dt, ph in rows:
        print(f"{p:<10} {100 * f:>7g}% {rate / 1e6:>9.3f} {rate / bare:>11.2f} {dt:>7.2f} {100 * ph:>13.2f}")
    if "lru" in wall:
        print(f"\nCPU time relative to lru (sum over capacities {a.capacities}):")
        for p in names:
            print(f"  {p:<10} {wall[p] / wall['lru']:6.2f}x")
    if a.cli:
        _cli_pairs(a.trace, fracs[0], [x for x in ("lru", "learned") if x in names], a.pairs)
    return 0


def _cli_pairs(trace: str, frac: float, policies: list[str], pairs: int) -> None:
    """Time whole ``kvtier replay`` commands, lru and learned alternating (``pairs`` times): wall and CPU
    (user + sys of the child) per command, the learned/lru ratio of each pair and their median. Pairs
    alternate because this host's speed drifts by tens of percent within minutes."""
    exe = Path(sys.executable).with_name("kvtier")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "kvtier"]
    env = {**os.environ, "DO_NOT_TRACK": "1"}
    ratios: list[float] = []
    cpu_ratios: list[float] = []
    for i in range(max(1, pairs)):
        wall, cpu = {}, {}
        for p in policies:
            r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
            t0 = time.perf_counter()  # a child process: wall time
            args = ["replay", trace, "--policy", p, "--capacity", str(frac), "--format", "json"]
            subprocess.run([*cmd, *args], check=True, capture_output=True, env=env)
            wall[p] = time.perf_counter() - t0
            r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu[p] = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
        line = " ".join(f"{p} {wall[p]:.2f} s wall ({cpu[p]:.2f} s CPU)" for p in policies)
        if "learned" in wall and "lru" in wall:
            ratios.append(wall["learned"] / wall["lru"])
            cpu_ratios.append(cpu["learned"] / cpu["lru"])
            line += f"  -> learned/lru {ratios[-1]:.2f}x wall, {cpu_ratios[-1]:.2f}x CPU"
        print(f"`kvtier replay {trace} --capacity {frac}` pair {i + 1}: {line}")
    if ratios:
        print(
            f"learned/lru whole-command wall time: median {statistics.median(ratios):.2f}x "
            f"(pairs {min(ratios):.2f}-{max(ratios):.2f}x; CPU median {statistics.median(cpu_ratios):.2f}x; "
            "goal <= 10x)"
        )


if __name__ == "__main__":
    raise SystemExit(main())
