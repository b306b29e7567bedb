"""``learned`` against every classic policy and Belady, per capacity, plus the learned/LRU time ratio.

    python -m bench.learned_vs_classic [--trace bundled|PATH|multiturn|shared-doc|subsample|subsample25|
        stretch|longdoc|longdoc2|all] [--capacities 0.01,0.02,0.05,0.1,0.2,0.4] [--no-cli]

Prints token-weighted prefix hit (%), gap closed (policy - LRU) / (Belady - LRU), the best classic
policy at each capacity, learned - best classic (pt) and the issue's two checks: never more than 0.3 pt
below the best classic; at 1/2/5/10 % close >= 0.05 more of the gap than it. Then it times two whole
``kvtier replay TRACE --policy lru|learned`` commands (same capacity) in this run and prints the ratio.
Variants: ``multiturn`` = generated multi-turn chat trace, ``shared-doc`` = generated Zipf-popular
shared documents + unique questions, ``subsample`` = 50 % of the conversation
trace's sessions (``subsample25``: 25 %, another seed), ``stretch`` = conversation with inter-arrival times
x 0.5, ``longdoc``/``longdoc2`` = short traces of long requests over large shared documents shaped like
Mooncake's *synthetic* trace (all seeded). ``all`` runs every variant and prints only the
learned - best classic margins (one row per variant).
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import time

from kvtier.policies.registry import CLASSIC, get_policy
from kvtier.replay.engine import replay
from kvtier.replay.runner import gap_closed, load_workload
from kvtier.replay.synthetic import (
    long_document_trace,
    multiturn_trace,
    shared_document_trace,
    subsample_sessions,
    time_stretch,
)
from kvtier.replay.trace import distinct_blocks

VARIANTS = (
    "bundled",
    "subsample",
    "subsample25",
    "stretch",
    "multiturn",
    "shared-doc",
    "longdoc",
    "longdoc2",
)


def _requests(trace: str) -> tuple[list, str]:
    if trace == "multiturn":
        return multiturn_trace(6000, seed=1), "generated multi-turn (6000 requests, seed 1)"
    if trace == "shared-doc":
        return shared_document_trace(4000, seed=1), "generated shared-document (4000 requests, seed 1)"
    if trace == "longdoc":
        return long_document_trace(3993, seed=1), "generated long shared documents (3993 requests, seed 1)"
    if trace == "longdoc2":
        return (
            long_document_trace(3993, seed=2, n_docs=2500, p_follow=0.3, zipf_a=0.9, doc_log_mean=2.8),
            "generated long shared documents, variant 2 (3993 requests, seed 2)",
        )
    if trace in ("subsample", "subsample25", "stretch"):
        base = load_workload("bundled").requests
        if trace == "subsample":
            return subsample_sessions(base, 0.5, seed=1), "conversation, 50 % of sessions (seed 1)"
        if trace == "subsample25":
            return subsample_sessions(base, 0.25, seed=3), "conversation, 25 % of sessions (seed 3)"
        return time_stretch(base, 0.5), "conversation, inter-arrival x 0.5"
    wl = load_workload(trace)
    return wl.requests, str(wl.path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default="bundled")
    ap.add_argument("--capacities", default="0.01,0.02,0.05,0.1,0.2,0.4")
    ap.add_argument("--no-cli", action="store_true", help="skip the whole-command timing")
    a = ap.parse_args(argv)
    if a.trace == "all":
        return _all_variants([float(x) for x in a.capacities.split(",")])
    reqs, label = _requests(a.trace)
    distinct = distinct_blocks(reqs)
    fracs = [float(x) for x in a.capacities.split(",")]
    names = [*CLASSIC, "belady", "learned"]
    pfx: dict[str, list[float]] = {n: [] for n in names}
    blk: dict[str, list[float]] = {n: [] for n in names}
    secs: dict[str, float] = {n: 0.0 for n in names}
    for f in fracs:
        cap = round(f * distinct)
        for n in names:
            t0 = time.perf_counter()
            s = replay(reqs, get_policy(n, cap, 0))
            secs[n] += time.perf_counter() - t0
            pfx[n].append(100 * s.prefix_hit_ratio)
            blk[n].append(100 * s.block_hit_ratio)
    print(f"trace: {label}; {len(reqs)} requests, {distinct} distinct blocks")
    print("prefix hit %  (gap closed)")
    print(f"{'policy':<10}" + "".join(f"{f * 100:>16g}%" for f in fracs) + "   replay s")
    for n in names:
        cells = []
        for i in range(len(fracs)):
            g = gap_closed(pfx[n][i], pfx["lru"][i], pfx["belady"][i], min_gap=1.0)
            cells.append(f"{pfx[n][i]:>8.2f} ({'  n/a' if g is None else f'{g:+.2f}'})")
        print(f"{n:<10}" + "".join(f"{c:>17}" for c in cells) + f"   {secs[n]:8.1f}")
    ok_all = True
    print("\ncapacity  best classic      learned-best(pt)  gap(best)  gap(learned)  never-worse  +0.05 gap")
    for i, f in enumerate(fracs):
        best = max(CLASSIC, key=lambda n: pfx[n][i])
        d = pfx["learned"][i] - pfx[best][i]
        gb = gap_closed(pfx[best][i], pfx["lru"][i], pfx["belady"][i], min_gap=1.0)
        gl = gap_closed(pfx["learned"][i], pfx["lru"][i], pfx["belady"][i], min_gap=1.0)
        never = d >= -0.3
        more = "n/a"
        if f <= 0.10 and gb is not None and gl is not None:
            more = "ok" if gl >= gb + 0.05 else "NO"
        ok_all &= never
        print(
            f"{f * 100:>7g}%  {best:<8} {pfx[best][i]:6.2f}  {d:>+14.2f}  "
            f"{'n/a' if gb is None else f'{gb:+.2f}':>9}  {'n/a' if gl is None else f'{gl:+.2f}':>12}"
            f"  {'ok' if never else 'NO':>11}  {more:>9}"
        )
    print("\nblock hit %")
    for n in names:
        print(f"{n:<10}" + "".join(f"{v:>9.2f}" for v in blk[n]))
    print(f"\nnever worse than the best classic (-0.3 pt) at every capacity: {'yes' if ok_all else 'NO'}")
    if not a.no_cli and a.trace == "bundled":
        cap_arg = str(round(0.05 * distinct))
        wall, cpu = {}, {}
        for n in ("lru", "learned"):
            c0 = resource.getrusage(resource.RUSAGE_CHILDREN)
            t0 = time.perf_counter()
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "kvtier",
                    "replay",
                    "bundled",
                    "--policy",
                    n,
                    "--capacity-blocks",
                    cap_arg,
                    "--format",
                    "json",
                ],
                check=True,
                stdout=subprocess.DEVNULL,
            )
            wall[n] = time.perf_counter() - t0
            c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu[n] = (c1.ru_utime + c1.ru_stime) - (c0.ru_utime + c0.ru_stime)
        print(
            f"whole `kvtier replay bundled --capacity-blocks {cap_arg}`: lru {wall['lru']:.2f} s, "
            f"learned {wall['learned']:.2f} s, learned/lru = {wall['learned'] / wall['lru']:.2f}x "
            "(target <= 10x)"
        )
        print(
            f"  CPU time (user+sys, robust on a shared machine): lru {cpu['lru']:.2f} s, learned "
            f"{cpu['learned']:.2f} s, learned/lru = {cpu['learned'] / cpu['lru']:.2f}x"
        )
    return 0


def _all_variants(fracs: list[float]) -> int:
    """learned - best classic (pt) on every variant x capacity; the "never worse" check everywhere."""
    print("learned - best classic, prefix hit pt (best classic in brackets)")
    print(f"{'variant':<12}" + "".join(f"{f * 100:>15g}%" for f in fracs))
    worst = float("inf")
    for v in VARIANTS:
        reqs, _ = _requests(v)
        distinct = distinct_blocks(reqs)
        cells = []
        for f in fracs:
            cap = round(f * distinct)
            c = {n: 100 * replay(reqs, get_policy(n, cap, 0)).prefix_hit_ratio for n in CLASSIC}
            best = max(CLASSIC, key=lambda n: c[n])
            d = 100 * replay(reqs, get_policy("learned", cap, 0)).prefix_hit_ratio - c[best]
            worst = min(worst, d)
            cells.append(f"{d:+.2f} ({best})")
        print(f"{v:<12}" + "".join(f"{x:>16}" for x in cells), flush=True)
    print(
        f"\nworst margin {worst:+.2f} pt; never more than 0.3 pt below the best classic: "
        f"{'yes' if worst >= -0.3 else 'NO'}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
