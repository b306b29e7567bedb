"""``stable_argsort`` vs numpy's stable int64 argsort: time ratio measured in one run (interleaved).

Keys as the KV-event hot path sees them: a window of block keys (random 64-bit hashes) with repeats
(a block stored, then touched). Prints per size: median seconds of each and numpy/ours (> 1: ours faster).

Usage: python -m bench.stable_argsort [--repeat 41]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from kvtier.policies.index_bulk import stable_argsort


def _keys(n: int, rng: np.random.Generator) -> np.ndarray:
    distinct = rng.integers(-(2**63), 2**63 - 1, size=max(1, n // 3), dtype=np.int64)
    return distinct[rng.integers(0, distinct.size, size=n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=41)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    print(f"{'n':>9} {'numpy stable s':>15} {'stable_argsort s':>17} {'numpy/ours':>11}")
    for n in (1_000, 16_384, 131_072, 1_048_576):
        x = _keys(n, rng)
        assert stable_argsort(x).tolist() == np.argsort(x, kind="stable").tolist()
        a, b = [], []
        for _ in range(args.repeat):  # interleaved, so machine-load drift hits both alike
            t0 = time.perf_counter()
            np.argsort(x, kind="stable")
            t1 = time.perf_counter()
            stable_argsort(x)
            t2 = time.perf_counter()
            a.append(t1 - t0)
            b.append(t2 - t1)
        ma, mb = float(np.median(a)), float(np.median(b))
        print(f"{n:>9} {ma:>15.6f} {mb:>17.6f} {ma / mb:>11.2f}")


if __name__ == "__main__":
    main()
