"""Where ``learned`` loses tokens in one cell: per-window prefix-hit tokens of each expert and the real cache.

    python -m bench.learned_windows --variant ho-longdoc2-s26 --capacity 0.4 [--seed 0] [--window 250]
        [--kw '{"lead_bias": 3.0}']

Every expert is a full-size shadow cache over the same requests, so its total is (up to the training
horizon, which follows the real cache's evictions) what it would get on its own. Prints each expert's
and the real cache's total (%), the switch log, then one row per window: thousands of prefix-hit tokens
per expert and for the real cache, the followed expert at the window's end, and how many resident blocks
of the real cache the followed expert does not hold (the hand-off still to be paid by misses).
Diagnostic only: per-request expert tokens from :meth:`LearnedPolicy.last_expert_tokens`.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from bench.learned_seeds import _variant
from kvtier.policies.base import prefix_tokens
from kvtier.policies.learned import LearnedPolicy
from kvtier.replay.trace import distinct_blocks


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", default="ho-longdoc2-s26")
    ap.add_argument("--capacity", type=float, default=0.4, help="fraction of the distinct blocks")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--window", type=int, default=250, help="requests per row")
    ap.add_argument("--kw", default="{}", help="LearnedPolicy keyword arguments (JSON object)")
    a = ap.parse_args(argv)
    reqs = _variant(a.variant)
    cap = round(a.capacity * distinct_blocks(reqs))
    pol = LearnedPolicy(cap, seed=a.seed, **json.loads(a.kw))
    k = len(pol.expert_names)
    names = [*pol.expert_names, "real"]
    tok = np.zeros((len(reqs), k + 1))
    rows: list[str] = []
    for i, r in enumerate(reqs):
        h = pol.access(r)
        if len(r.hash_ids):  # (an empty request leaves the policy's last row as it was)
            tok[i, :k] = pol.last_expert_tokens()
        tok[i, k] = prefix_tokens(r, int(h.argmin()) if h.shape[0] and not h.all() else h.shape[0])
        if (i + 1) % a.window == 0 or i + 1 == len(reqs):
            w = tok[i + 1 - ((i % a.window) + 1) : i + 1].sum(0)
            off = pol.handoff_blocks
            lead = pol.followed_expert
            rows.append(f"{i + 1:>6}" + "".join(f"{x / 1000:>10.0f}" for x in w) + f"  {lead:<18}{off:>8}")
    total = sum(r.input_length for r in reqs)
    print(f"{a.variant} at {100 * a.capacity:g} % ({cap} blocks), policy seed {a.seed}, kw {a.kw}")
    pct = (f"{n} {100 * t / total:.2f}" for n, t in zip(names, tok.sum(0), strict=True))
    print("totals (%): " + "  ".join(pct))
    for sw in pol.switch_log:
        print(f"switch at {sw['request']}: {sw['from']} -> {sw['to']} (z {sw['z']:.2f})")
    print(f"{'upto':>6}" + "".join(f"{n[-9:]:>10}" for n in names) + f"  {'followed':<18}{'off-set':>8}")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
