"""The seed's scenario on the simulator: the three ``kvtier demo`` arms at concurrency 8 and 16, beside the
seed's own claims, as the markdown table of ``docs/sim.md``.

    python -m bench.sim_seed                 # both concurrencies, markdown to stdout
    python -m bench.sim_seed --json FILE     # also every arm's full figures

Ratios are measured in one run (same trace slice, same process). The seed's claims (its benchmark, real
hardware): with tiering +29-40 % throughput and -26-32 % TTFT p50; at concurrency 16 against recompute,
4.1 -> 74.9 tok/s and TTFT p50 149.5 s -> 11.85 s.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvtier.controller.demo import DemoOptions, run_demo

SEED = {
    "tiering vs recompute (c=16): throughput": "4.1 -> 74.9 tok/s (x18.3)",
    "tiering vs recompute (c=16): TTFT p50": "149.5 s -> 11.85 s (-92 %)",
    "tiering: throughput": "+29-40 %",
    "tiering: TTFT p50": "-26-32 %",
}


def _pct(a: float, b: float) -> str:
    return f"{(b / a - 1) * 100:+.0f} %" if a else "n/a"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--max-requests", type=int, default=None)
    args = ap.parse_args()
    out: dict[str, Any] = {}
    rows = []
    for c in (8, 16):
        res = run_demo(DemoOptions(scenario="seed-480b", concurrency=c, listen="127.0.0.1:0",
                                   max_requests=args.max_requests))  # fmt: skip
        out[str(c)] = res
        a = res["arms"]
        n, d, k = a["no_offload"], a["default"], a["kvtier"]
        for key, label, f in (
            ("throughput_tokens_per_s", "throughput (tok/s)", ".1f"),
            ("ttft_p50_s", "TTFT p50 (s)", ".2f"),
            ("ttft_p99_s", "TTFT p99 (s)", ".2f"),
        ):
            diff = res["comparison"]["kvtier_minus_default"][key]
            rows.append(
                f"| {c} | {label} | {format(n[key], f)} ± {format(n[key + '_ci95'], f)} "
                f"| {format(d[key], f)} ± {format(d[key + '_ci95'], f)} "
                f"| {format(k[key], f)} ± {format(k[key + '_ci95'], f)} "
                f"| {_pct(n[key], d[key])} | {_pct(d[key], k[key])} "
                f"({format(diff['mean'], '+' + f)} ± {format(diff['ci95'], f)}) |"
            )
        rows.append(
            f"| {c} | prefix hit | {100 * n['hit_ratio']:.1f} % | {100 * d['hit_ratio']:.1f} % "
            f"| {100 * k['hit_ratio']:.1f} % | | |"
        )
    print(f"seed-480b, {out['16']['requests']} requests (95 % CI, batch means)\n")
    print("| concurrency | metric | no offload (recompute) | layer default (LRU) | kvtier (active) "
          "| default vs no offload | kvtier vs default (paired diff) |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|")
    print("\n".join(rows))
    print("\nThe seed's claims (its benchmark):\n")
    for k2, v in SEED.items():
        print(f"- {k2}: {v}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2, default=str)


if __name__ == "__main__":
    main()
