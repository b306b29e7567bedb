"""Block index at scale: measured memory per tracked block and store/touch/victim rates, one run.

    python -m bench.index_scale [--blocks 2000000]

Random uint64 hashes in chains of 32 (vLLM-like), stored into the GPU tier, then touched, then leaf-first
victims picked. Prints bytes per block (resident-set growth, /proc/self/statm) against the 256 B budget,
and the projection to 10 M.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from kvtier.policies.index import BlockIndex


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=2_000_000)
    a = ap.parse_args(argv)
    n = a.blocks
    hashes = np.random.default_rng(0).integers(0, 2**63, n, dtype=np.int64)
    hl = [int(h) | (1 << 63) if i % 2 else int(h) for i, h in enumerate(hashes)]  # half above int64 range
    base = _rss()
    ix = BlockIndex()
    t0 = time.perf_counter()
    chain = 32
    for i in range(0, n, chain):
        ix.store_chain(hl[i : i + chain], None, "gpu", nbytes=64 << 20, t=float(i))
    t_store = time.perf_counter() - t0
    used = _rss() - base
    t0 = time.perf_counter()
    for i in range(0, n, 7):
        ix.touch(hl[i], float(n + i))
    t_touch = time.perf_counter() - t0
    t0 = time.perf_counter()
    victims = ix.pick_victims("gpu", 10_000)
    t_pick = time.perf_counter() - t0
    per = used / n
    print(f"blocks tracked            {len(ix):,}")
    print(f"memory per block          {per:.1f} B (budget 256 B: {per / 256:.2f} of it)")
    print(f"projected for 10 M blocks {per * 10e6 / 2**30:.2f} GiB")
    print(f"store rate                {n / t_store / 1e6:.3f} M blocks/s (chains of {chain})")
    print(f"touch rate                {len(range(0, n, 7)) / t_touch / 1e6:.3f} M/s")
    print(f"pick 10k leaf victims     {t_pick * 1e3:.1f} ms ({len(victims)} picked)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
