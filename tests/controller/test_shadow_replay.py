"""Shadow mode on a replayed real trace (bundled Mooncake conversation trace) reports the counterfactual hit
gain of its decisions, and its upward decisions beat the base rate of blocks coming back."""

from __future__ import annotations

import numpy as np

from kvtier.controller.shadow_replay import run_shadow_replay
from kvtier.replay.trace import bundled_trace_path, load_trace


def test_shadow_replay_reports_counterfactual_hit_gain() -> None:
    reqs = load_trace(bundled_trace_path(), max_requests=2500)
    out = run_shadow_replay(reqs, gpu_blocks=3000, tick_s=5.0, horizon_s=120.0)
    loop = out.pop("loop")
    sh = out["shadow"]
    assert out["decisions"] > 0 and sh["scored"] == out["decisions"]  # every decision scored by the end
    assert sh["upward"] > 0 and sh["downward"] > 0
    assert out["counterfactual_hit_gain_blocks"] == sh["hits_gained"] > 0
    assert out["counterfactual_hit_gain_tokens"] == sh["hits_gained"] * 512
    ds = list(loop.decisions)
    assert all(d.outcome == "shadow" and d.score is not None for d in ds)

    # base rate: of blocks seen but not resident at a decision time, how many came back within the horizon
    times: dict[int, list[float]] = {}
    for r in reqs:
        for h in r.hash_ids.tolist():
            times.setdefault(h, []).append(r.timestamp_ms / 1000.0)
    rng = np.random.default_rng(0)
    keys = np.array(list(times.keys()))
    up = [d for d in ds if d.action in ("admit", "prefetch", "promote")]
    base_back = base_n = 0
    for d in up[:: max(1, len(up) // 200)]:
        for h in rng.choice(keys, 50).tolist():
            ts = times[h]
            if ts[0] >= d.at_s:
                continue  # not seen yet at decision time
            base_n += 1
            base_back += any(d.at_s < t <= d.at_s + 120.0 for t in ts)
    base_rate = base_back / max(1, base_n)
    precision = sh["precision"]
    print({k: v for k, v in out.items()}, "base_rate", base_rate)
    assert precision > 2 * base_rate, (precision, base_rate)
