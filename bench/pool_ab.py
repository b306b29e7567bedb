"""Pool several live A/B JSONs (``kvtier bench --json`` / ``bench.live_ab --json`` of separate invocations on
the same setup) into one ratio per figure, beside each series' own: the run-weighted geometric mean of the
series' ratios, with a bootstrap 95 % CI that resamples runs within each series (an invocation is a block:
hosts differ in speed).

Usage: python -m bench.pool_ab A.json B.json [...] [--arm active]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from kvtier.replay.live_bench import pool_series


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", type=Path, nargs="+")
    ap.add_argument("--arm", default="active")
    a = ap.parse_args()
    docs = [json.loads(p.read_text()) for p in a.files]
    out = pool_series(docs, a.arm)
    print(f"{a.arm} vs baseline, {out['series']} series")
    print(f"{'figure':<20} {'pooled':>7} {'95 % CI':>17} {'runs':>7}  per series")
    for f, r in out["fields"].items():
        lo, hi = r["ci95"]
        each = ", ".join(f"{x:.3f}" for x in r["per_series"])
        ratio = "-" if math.isnan(r["ratio"]) else f"{r['ratio']:.3f}"
        print(f"{f:<20} {ratio:>7} [{lo:>6.3f}, {hi:>6.3f}] {r['runs'][0]:>3}/{r['runs'][1]:<3}  {each}")


if __name__ == "__main__":
    main()
