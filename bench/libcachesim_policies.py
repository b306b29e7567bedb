"""Block hit ratio of libCacheSim's policies next to kvtier's on one trace, one run (needs the dev extra).

    python -m bench.libcachesim_policies [--trace bundled] [--capacities 0.01,0.02,0.05,0.1] [--all]

Feeds the trace's block access sequence (unit-size objects, clock = request time in s) to libCacheSim
(PyPI ``libcachesim``), at the same capacities (round(fraction x distinct blocks)). The issue's bar for
``learned``: a block hit ratio at least that of every libCacheSim policy at 1-10 %.
"""

from __future__ import annotations

import argparse
import time

import libcachesim as lcs
import numpy as np

from kvtier.policies.registry import get_policy, is_available
from kvtier.replay.engine import replay
from kvtier.replay.runner import load_workload

NAMED = ["LRU", "FIFO", "ARC", "S3FIFO", "WTinyLFU", "LRB", "GLCache", "ThreeLCache"]
NAMED += ["LIRS", "TwoQ", "Cacheus", "Sieve", "SLRU", "LFUDA"]
ALL_EXTRA = ["LFU", "LeCaR", "LHD", "ClockPro", "Hyperbolic", "GDSF", "Clock", "LRUProb", "FlashProb", "MQ"]


def lcs_block_hits(cls: type, cap: int, ids: list[int], clock: list[int]) -> int:
    cache = cls(cap)
    r = lcs.Request()
    r.obj_size = 1
    h = 0
    for b, c in zip(ids, clock, strict=True):
        r.obj_id = b
        r.clock_time = c
        h += bool(cache.get(r))
    return h


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default="bundled")
    ap.add_argument("--capacities", default="0.01,0.02,0.05,0.1")
    ap.add_argument("--all", action="store_true", help="every libCacheSim policy that runs with defaults")
    ap.add_argument("--ours", default="lru,s3fifo,arc,learned")
    a = ap.parse_args(argv)
    wl = load_workload(a.trace)
    ids = np.concatenate([r.hash_ids for r in wl.requests]).tolist()
    clock = np.concatenate(
        [np.full(len(r.hash_ids), int(r.timestamp_ms // 1000), dtype=np.int64) for r in wl.requests]
    ).tolist()
    fracs = [float(x) for x in a.capacities.split(",")]
    caps = [round(f * wl.distinct_blocks) for f in fracs]
    names = NAMED + (ALL_EXTRA if a.all else [])
    print(f"trace {wl.path.name}: {len(ids)} block accesses; block hit %, capacities {caps}")
    print(f"{'policy':<22}" + "".join(f"{100 * f:>8g}%" for f in fracs))
    best = [0.0] * len(fracs)
    for n in names:
        cls = getattr(lcs, n, None)
        if cls is None:
            continue
        t0 = time.perf_counter()
        try:
            vals = [lcs_block_hits(cls, c, ids, clock) / len(ids) for c in caps]
        except Exception as e:  # a policy that needs parameters we do not set
            print(f"libcachesim:{n:<11} failed: {e}")
            continue
        best = [max(b, v) for b, v in zip(best, vals, strict=True)]
        row = "".join(f"{100 * v:>9.2f}" for v in vals)
        print(f"libcachesim:{n:<10}{row}   ({time.perf_counter() - t0:.1f} s)")
    print(f"{'best of libCacheSim':<22}" + "".join(f"{100 * v:>9.2f}" for v in best))
    for p in [x for x in a.ours.split(",") if x]:
        if not is_available(p):
            print(f"kvtier:{p:<15} not registered here")
            continue
        vals = [replay(wl.requests, get_policy(p, c, 0)).block_hit_ratio for c in caps]
        ratio = "  ".join(f"{v / b:.3f}" if b else "n/a" for v, b in zip(vals, best, strict=True))
        print(f"kvtier:{p:<15}" + "".join(f"{100 * v:>9.2f}" for v in vals) + f"   / best: {ratio}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
