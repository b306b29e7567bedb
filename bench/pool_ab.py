"""Pool several live A/B JSONs (``kvtier bench --json`` / ``bench.live_ab --json`` of separate invocations on
the same setup) into one ratio per figure, beside each series' own: the run-weighted geometric mean of the
series' ratios, with a bootstrap 95 % CI that resamples runs within each series (an invocation is a block:
hosts differ in speed).

Usage: python -m bench.pool_ab A.json B.json[:ARM] [...] [--arm active]

``FILE:ARM`` takes that series' arm ``ARM`` as ``--arm`` (the same configuration run under another name, e.g.
a variant arm that later became the default).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from kvtier.replay.live_bench import pool_series


def load_series(spec: str, arm: str) -> dict[str, Any]:
    """A bench JSON; with ``FILE:ARM``, its arm ``ARM`` under the name ``arm`` (the arm of that name it had
    is dropped). A missing arm is a one-line error."""
    path, _, own = spec.rpartition(":") if ":" in spec and not Path(spec).exists() else (spec, "", "")
    doc: dict[str, Any] = json.loads(Path(path).read_text())
    if own:
        arms = doc.get("arms", {})
        if own not in arms:
            raise SystemExit(f"{path}: no arm {own!r} (arms: {', '.join(arms)})")
        arms[arm] = arms.pop(own)
    return doc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", help="bench JSONs, each optionally FILE:ARM")
    ap.add_argument("--arm", default="active")
    a = ap.parse_args()
    docs = [load_series(spec, a.arm) for spec in a.files]
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
